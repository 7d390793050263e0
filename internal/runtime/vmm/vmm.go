// Package vmm is what the vm (QEMU) and microvm (Firecracker) backends do
// alike with the VMM process each sandbox runs on the host: the run file
// Recover reads after a node restart, the process found, checked, watched
// and killed through /proc and pidfds (proc_linux.go), and the sizes and
// digests of the files a snapshot's manifest records.
package vmm

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"io"
	"os"
	"strings"

	"github.com/kernflux/opendsec/internal/errdefs"
)

// FileSum is a file's size and, when recorded, its sha256 (hex): what a
// snapshot manifest keeps so a truncated or corrupted file is refused
// before anything is made from it.
type FileSum struct {
	Size   int64  `json:"size"`
	SHA256 string `json:"sha256,omitempty"`
}

// SumFile is path's size and, with digest, its sha256.
func SumFile(path string, digest bool) (FileSum, error) {
	f, err := os.Open(path)
	if err != nil {
		return FileSum{}, err
	}
	defer func() { _ = f.Close() }()
	fi, err := f.Stat()
	if err != nil {
		return FileSum{}, err
	}
	s := FileSum{Size: fi.Size()}
	if digest {
		if _, s.SHA256, err = HashReader(f); err != nil {
			return FileSum{}, err
		}
	}
	return s, nil
}

// HashReader reads r to its end: how many bytes, and their sha256 (hex).
func HashReader(r io.Reader) (int64, string, error) {
	h := sha256.New()
	n, err := io.Copy(h, r)
	if err != nil {
		return 0, "", err
	}
	return n, hex.EncodeToString(h.Sum(nil)), nil
}

// WriteRunFile replaces the run file path with v as JSON atomically: it is
// written to path+".tmp", synced and renamed, so a node killed meanwhile
// leaves the old file or the new one, never a part. On error the
// temporary file is gone and path is as it was.
func WriteRunFile(path string, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	tmp := path + ".tmp"
	f, err := os.OpenFile(tmp, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	_, err = f.Write(b)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err != nil {
		_ = os.Remove(tmp)
	}
	return err
}

// ReadRunFile reads the run file path into v. A file that cannot be read
// is os.ReadFile's error as it is (fs.ErrNotExist: there is none); one
// that does not parse is errdefs.ErrInternal.
func ReadRunFile(path string, v any) error {
	b, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	if err := json.Unmarshal(b, v); err != nil {
		return errdefs.New(errdefs.ErrInternal, "run state %s: %w", path, err)
	}
	return nil
}

// LastLines is the last n lines of a log, joined by " | " (for an error
// message).
func LastLines(b []byte, n int) string {
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, " | ")
}
