package image

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"

	"github.com/kernflux/opendsec/internal/errdefs"
)

// Files kept with an image. A node keeps with a container snapshot's image
// (snapshot/<id>) what a sandbox started from it needs besides its files —
// the source's trajectory log — so that any node sharing the store has it.
// An image's files go with Remove(name); Prune does not touch them.

var fileKeyRE = regexp.MustCompile(`^[a-z0-9][a-z0-9._-]{0,63}$`)

func (s *Store) filesDir(name string) string {
	return s.path("files", urlEscape(name))
}

// PutFile copies the file at src into the store as file key of image
// name, replacing one it had; the copy appears whole or not at all.
func (s *Store) PutFile(ctx context.Context, name, key, src string) error {
	n, err := NormalizeName(name)
	if err != nil {
		return errdefs.Invalid("name", "%v", err)
	}
	if !fileKeyRE.MatchString(key) {
		return errdefs.Invalid("key", "%q is not a file key", key)
	}
	in, err := os.Open(src)
	if err != nil {
		return fmt.Errorf("image file %s of %s: %w", key, n, err)
	}
	defer in.Close()
	dir := s.filesDir(n)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("image file %s of %s: %w", key, n, err)
	}
	tmp, err := os.CreateTemp(dir, "."+key+".tmp*")
	if err != nil {
		return fmt.Errorf("image file %s of %s: %w", key, n, err)
	}
	_, err = io.Copy(tmp, in)
	if err == nil {
		err = tmp.Sync()
	}
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp.Name(), filepath.Join(dir, key))
	}
	if err != nil {
		os.Remove(tmp.Name())
		return fmt.Errorf("image file %s of %s: %w", key, n, err)
	}
	return nil
}

// File returns the path of file key of image name, or not_found.
func (s *Store) File(name, key string) (string, error) {
	n, err := NormalizeName(name)
	if err != nil {
		return "", errdefs.Invalid("name", "%v", err)
	}
	if !fileKeyRE.MatchString(key) {
		return "", errdefs.Invalid("key", "%q is not a file key", key)
	}
	p := filepath.Join(s.filesDir(n), key)
	if _, err := os.Stat(p); errors.Is(err, fs.ErrNotExist) {
		return "", errdefs.New(errdefs.ErrNotFound, "image %s has no file %s", n, key)
	} else if err != nil {
		return "", fmt.Errorf("image file %s of %s: %w", key, n, err)
	}
	return p, nil
}

// removeFiles removes image n's files (Remove).
func (s *Store) removeFiles(n string) error {
	if err := os.RemoveAll(s.filesDir(n)); err != nil {
		return fmt.Errorf("remove files of image %s: %w", n, err)
	}
	return nil
}
