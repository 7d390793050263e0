package fsutil

import (
	"errors"
	"io"
	"os"

	"golang.org/x/sys/unix"
)

// CopySparse copies src to a new file dst (mode 0600; an existing dst is
// an error), only src's data extents (SEEK_DATA/SEEK_HOLE): dst has src's
// size and holes where src has them. The data goes with copy_file_range
// where the kernel can. On error dst is removed.
func CopySparse(src, dst string) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer func() { _ = in.Close() }()
	return CopySparseFrom(in, dst)
}

// CopySparseFrom is CopySparse from an open file (read through in only,
// whatever its name now names).
func CopySparseFrom(in *os.File, dst string) (err error) {
	fi, err := in.Stat()
	if err != nil {
		return err
	}
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	defer func() {
		if cerr := out.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			_ = os.Remove(dst)
		}
	}()
	size := fi.Size()
	if err := out.Truncate(size); err != nil {
		return err
	}
	ifd := int(in.Fd())
	for off := int64(0); off < size; {
		data, err := unix.Seek(ifd, off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			break // only a hole is left
		} else if err != nil {
			return err
		}
		hole, err := unix.Seek(ifd, data, unix.SEEK_HOLE)
		if err != nil {
			return err
		}
		if err := copyRange(in, out, data, hole-data); err != nil {
			return err
		}
		off = hole
	}
	return nil
}

// copyRange copies n bytes at off from in to the same offset of out.
func copyRange(in, out *os.File, off, n int64) error {
	roff, woff := off, off
	for n > 0 {
		k, err := unix.CopyFileRange(int(in.Fd()), &roff, int(out.Fd()), &woff, int(min(n, 1<<30)), 0)
		if err != nil {
			if errors.Is(err, unix.EXDEV) || errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOSYS) || errors.Is(err, unix.EOPNOTSUPP) {
				_, err := io.Copy(io.NewOffsetWriter(out, woff), io.NewSectionReader(in, roff, n))
				return err
			}
			return err
		}
		if k == 0 {
			return io.ErrUnexpectedEOF
		}
		n -= int64(k)
	}
	return nil
}
