package node

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
)

// maxPasswdBytes bounds how much of an image's /etc/passwd is read.
const maxPasswdBytes = 1 << 20

// checkImageUser refuses a spec user the image does not have, at create
// rather than at the first exec (where the agent refuses the name). The
// user must be in the image's /etc/passwd, as the agent looks it up
// (internal/agent/users.go); root always exists. holder is the sandbox the
// layers are mounted for (the image hold's), so EROFS layers are mounted
// once for it, here or by the backend.
func checkImageUser(ctx context.Context, img runtime.Image, holder, user string) error {
	if user == "" || user == "root" {
		return nil
	}
	dirs, err := img.Rootfs.Dirs(ctx, holder)
	if err != nil {
		return fmt.Errorf("mount image layers: %w", err)
	}
	passwd, found, err := readLayered(dirs, "etc/passwd")
	if err != nil {
		return fmt.Errorf("read the image's /etc/passwd: %w", err)
	}
	if found == fileUnknown {
		return nil // not a plain file: the agent decides
	}
	if found == fileAbsent {
		return errdefs.Invalid("user", "%q does not exist in image %s: it has no /etc/passwd, so only root does; leave user empty or use root", user, img.Rootfs.Image)
	}
	sc := bufio.NewScanner(bytes.NewReader(passwd))
	sc.Buffer(make([]byte, 0, 4096), maxPasswdBytes)
	for sc.Scan() {
		name, _, _ := strings.Cut(strings.TrimSpace(sc.Text()), ":")
		if name == user {
			return nil
		}
	}
	return errdefs.Invalid("user", "%q does not exist in image %s (not in its /etc/passwd); leave user empty for the image's default, or name a user the image has", user, img.Rootfs.Image)
}

type layeredFile int

const (
	fileAbsent layeredFile = iota
	filePresent
	fileUnknown // a symlink or another non-regular file
)

// readLayered reads rel from layer directories stacked topmost first, as
// overlayfs shows it: the topmost layer that has it (or a whiteout of it,
// or an opaque parent) decides.
func readLayered(dirs []string, rel string) ([]byte, layeredFile, error) {
	for _, d := range dirs {
		p := filepath.Join(d, rel)
		fi, err := os.Lstat(p)
		switch {
		case errors.Is(err, syscall.ENOTDIR):
			return nil, fileAbsent, nil // a parent is a file here: it hides the lower layers'
		case errors.Is(err, fs.ErrNotExist):
			if opaqueParent(d, rel) {
				return nil, fileAbsent, nil
			}
			continue
		case err != nil:
			return nil, fileAbsent, err
		case isWhiteoutInfo(fi):
			return nil, fileAbsent, nil
		case !fi.Mode().IsRegular():
			return nil, fileUnknown, nil
		}
		f, err := os.Open(p)
		if err != nil {
			return nil, fileAbsent, err
		}
		b, err := io.ReadAll(io.LimitReader(f, maxPasswdBytes))
		f.Close()
		return b, filePresent, err
	}
	return nil, fileAbsent, nil
}
