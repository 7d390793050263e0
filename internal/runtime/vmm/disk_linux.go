package vmm

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"os/exec"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/vmchan"
)

// MakeSparse makes a new empty (sparse) file of size bytes, mode 0600.
func MakeSparse(path string, size int64) error {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
	if err != nil {
		return errdefs.New(errdefs.ErrInternal, "%w", err)
	}
	err = f.Truncate(size)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return errdefs.New(errdefs.ErrInternal, "%w", err)
	}
	return nil
}

// MakeDisk makes the guest's writable disk at path: a new sparse file of
// mb MiB with an empty ext4 labelled opendsec-rw (docs/vm-guest.md).
func MakeDisk(ctx context.Context, path string, mb int64) error {
	if err := MakeSparse(path, mb<<20); err != nil {
		return errdefs.New(errdefs.ErrInternal, "writable disk: %w", err)
	}
	out, err := exec.CommandContext(ctx, "mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=1,lazy_journal_init=1,nodiscard", "-L", "opendsec-rw", path).CombinedOutput()
	if err != nil {
		return errdefs.New(errdefs.ErrInternal, "writable disk mkfs.ext4: %w: %s", err, bytes.TrimSpace(out))
	}
	return nil
}

// maxConfigBytes bounds the configuration disk (the guest reads 1 MiB).
const maxConfigBytes = 1<<20 - 1

// WriteConfigDisk writes the guest's configuration disk at path:
// vmchan.GuestConfig of g as JSON, NUL-padded to whole 4 KiB blocks
// (docs/vm-guest.md). A configuration over 1 MiB is invalid (field guest).
func WriteConfigDisk(path string, g runtime.Guest) error {
	b, err := json.Marshal(vmchan.GuestConfig{Env: g.Env, User: g.User, Workdir: g.Workdir, Nameservers: g.Nameservers})
	if err != nil {
		return errdefs.New(errdefs.ErrInternal, "config disk: %w", err)
	}
	if len(b) > maxConfigBytes {
		return errdefs.Invalid("guest", "env, user, workdir and nameservers take %d bytes; keep them under 1 MiB", len(b))
	}
	b = append(b, make([]byte, (4096-len(b)%4096)%4096)...)
	if err := os.WriteFile(path, b, 0o600); err != nil {
		return errdefs.New(errdefs.ErrInternal, "config disk: %w", err)
	}
	return nil
}
