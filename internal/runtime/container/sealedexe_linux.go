package container

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"
)

// crun runs from a sealed memfd, not from its path.
//
// Against CVE-2019-5736 (a container process overwriting the runtime's
// binary through /proc/<pid>/exe of a runtime process that entered the
// container) every crun command first makes itself a private copy: it
// tries a read-only bind mount of /proc/self/exe over a temp file in /tmp
// (mkstemp, two mounts, an unmount, an unlink) and then fexecve's itself,
// so each command is two execs and two dynamic loads. That was about a
// fifth of crun's CPU in a batch create. crun skips all of it when
// /proc/self/exe already is a memfd whose seals are exactly
// F_SEAL_SEAL|F_SEAL_SHRINK|F_SEAL_GROW|F_SEAL_WRITE (libcrun's
// is_self_cloned; runc's contrib/cmd/memfd-bind is the same idea): nobody
// can change such a file, not even root, so there is nothing to protect.
// The node makes that copy once, keeps it open for its life and runs crun
// as /proc/self/fd/<n> (execve resolves the path before close-on-exec
// closes the fd in the child, so no child holds it).

// sealedExeSeals are the seals crun requires of its memfd: exactly these.
const sealedExeSeals = unix.F_SEAL_SEAL | unix.F_SEAL_SHRINK | unix.F_SEAL_GROW | unix.F_SEAL_WRITE

// sealedExeKey is a binary's identity: a binary replaced (a package
// upgrade) gets a new copy.
type sealedExeKey struct {
	path        string
	dev, ino    uint64
	size, mtime int64
}

// sealedExes are the process's sealed copies: made once per binary and
// kept open for the process's life (every Runtime of the process shares
// them).
var sealedExes struct {
	mu sync.Mutex
	m  map[sealedExeKey]*sealedFile
}

// sealedFile is a sealed copy: its fd and the identity it had when made.
type sealedFile struct {
	f        *os.File
	dev, ino uint64
	// lost is set once an exec of the copy failed or its fd no longer
	// is the copy: from then on the runtime runs from its path.
	lost atomic.Bool
}

// check reports whether the fd still is the sealed copy made (an fd
// closed by mistake elsewhere in the process and reused would be another
// file: executing it must never happen).
func (s *sealedFile) check() error {
	var st unix.Stat_t
	if err := unix.Fstat(int(s.f.Fd()), &st); err != nil {
		return fmt.Errorf("stat the sealed copy's fd %d: %w", s.f.Fd(), err)
	}
	if st.Dev != s.dev || st.Ino != s.ino {
		return fmt.Errorf("fd %d is no longer the sealed copy (dev/inode %d/%d, not %d/%d)", s.f.Fd(), st.Dev, st.Ino, s.dev, s.ino)
	}
	seals, err := unix.FcntlInt(s.f.Fd(), unix.F_GET_SEALS, 0)
	if err != nil || seals != sealedExeSeals {
		return fmt.Errorf("fd %d is no longer sealed as made (seals %#x, %v)", s.f.Fd(), seals, err)
	}
	return nil
}

// sealedExe returns a sealed memfd copy of the ELF binary at path (run as
// /proc/self/fd/<n>), made on the first call for that binary.
func sealedExe(path string) (*sealedFile, error) {
	src, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("open %s: %w", path, err)
	}
	defer src.Close()
	var st unix.Stat_t
	if err := unix.Fstat(int(src.Fd()), &st); err != nil {
		return nil, fmt.Errorf("stat %s: %w", path, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return nil, fmt.Errorf("%s is not a regular file", path)
	}
	magic := make([]byte, 4)
	if _, err := io.ReadFull(src, magic); err != nil || !bytes.Equal(magic, []byte("\x7fELF")) {
		// A script's interpreter would open /proc/self/fd/<n> after
		// close-on-exec closed it.
		return nil, fmt.Errorf("%s is not an ELF binary (a script cannot run from a memfd)", path)
	}
	key := sealedExeKey{path: path, dev: st.Dev, ino: st.Ino, size: st.Size, mtime: st.Mtim.Nano()}
	sealedExes.mu.Lock()
	defer sealedExes.mu.Unlock()
	if s := sealedExes.m[key]; s != nil && !s.lost.Load() {
		return s, nil
	}
	f, err := sealedCopy(src, st.Size)
	if err != nil {
		return nil, err
	}
	var fst unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &fst); err != nil {
		f.Close()
		return nil, fmt.Errorf("stat the sealed copy: %w", err)
	}
	if sealedExes.m == nil {
		sealedExes.m = map[sealedExeKey]*sealedFile{}
	}
	s := &sealedFile{f: f, dev: fst.Dev, ino: fst.Ino}
	sealedExes.m[key] = s
	return s, nil
}

// describe says what the copy's fd is now, for the log.
func (s *sealedFile) describe() string {
	target, err := os.Readlink(fdPath(s.f))
	if err != nil {
		return fmt.Sprintf("fd %d: %v", s.f.Fd(), err)
	}
	if err := s.check(); err != nil {
		return fmt.Sprintf("fd %d is %s: %v", s.f.Fd(), target, err)
	}
	return fmt.Sprintf("fd %d is still the sealed copy %s", s.f.Fd(), target)
}

// fdPath is the path through which the process's fd f is executed.
func fdPath(f *os.File) string { return "/proc/self/fd/" + strconv.Itoa(int(f.Fd())) }

// sealedCopy copies size bytes of src (from its start) into a new
// close-on-exec memfd and seals it with sealedExeSeals.
func sealedCopy(src *os.File, size int64) (*os.File, error) {
	// MFD_EXEC: executable even where vm.memfd_noexec makes memfds
	// noexec by default; kernels before 6.3 do not know it.
	fd, err := unix.MemfdCreate("crun", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING|unix.MFD_EXEC)
	if errors.Is(err, unix.EINVAL) {
		fd, err = unix.MemfdCreate("crun", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	}
	if err != nil {
		return nil, fmt.Errorf("memfd_create: %w", err)
	}
	f := os.NewFile(uintptr(fd), "memfd:crun")
	ok := false
	defer func() {
		if !ok {
			f.Close()
		}
	}()
	n, err := io.Copy(f, io.NewSectionReader(src, 0, size))
	if err != nil {
		return nil, fmt.Errorf("copy the binary into a memfd: %w", err)
	}
	if n != size {
		return nil, fmt.Errorf("copy the binary into a memfd: %d of %d bytes", n, size)
	}
	if _, err := unix.FcntlInt(f.Fd(), unix.F_ADD_SEALS, sealedExeSeals); err != nil {
		return nil, fmt.Errorf("seal the memfd: %w", err)
	}
	seals, err := unix.FcntlInt(f.Fd(), unix.F_GET_SEALS, 0)
	if err != nil {
		return nil, fmt.Errorf("read the memfd's seals: %w", err)
	}
	if seals != sealedExeSeals {
		return nil, fmt.Errorf("the memfd's seals are %#x, not %#x (vm.memfd_noexec?)", seals, sealedExeSeals)
	}
	// The child resolves /proc/self/fd/<n> after it made its stdio and
	// ExtraFiles fds 0, 1, 2, 3...: n must be none of them.
	high, err := unix.FcntlInt(f.Fd(), unix.F_DUPFD_CLOEXEC, sealedExeMinFD)
	if err != nil {
		return nil, fmt.Errorf("move the memfd to a high fd: %w", err)
	}
	ok = true
	f.Close()
	return os.NewFile(uintptr(high), "memfd:crun"), nil
}

// sealedExeMinFD is the lowest fd the sealed copy may have: far above the
// fds a child of the node gets (stdio and a few ExtraFiles).
const sealedExeMinFD = 64
