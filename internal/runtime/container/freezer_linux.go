package container

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/kernflux/opendsec/internal/errdefs"
)

// freezeTimeout bounds how long a freeze may take before it is undone: a task
// in an uninterruptible sleep (say, on a hung NFS server) can keep a v1
// cgroup in FREEZING forever.
const freezeTimeout = 10 * time.Second

// freezerFile returns the file that freezes the cgroup path and the value
// written to freeze or thaw it: cgroup.freeze ("1"/"0") on v2,
// freezer.state ("FROZEN"/"THAWED") on v1.
func (m cgroupMounts) freezerFile(path string, freeze bool) (string, string, error) {
	if m.v2 {
		v := "0"
		if freeze {
			v = "1"
		}
		return filepath.Join(m.unified, path, "cgroup.freeze"), v, nil
	}
	mnt, ok := m.v1["freezer"]
	if !ok {
		return "", "", errdefs.New(errdefs.ErrFailedPrecondition, "the cgroup v1 freezer controller is not mounted; mount it to pause sandboxes")
	}
	v := "THAWED"
	if freeze {
		v = "FROZEN"
	}
	return filepath.Join(mnt, path, "freezer.state"), v, nil
}

// frozen reports whether the cgroup path is completely frozen.
func (m cgroupMounts) frozen(path string) (bool, error) {
	if m.v2 {
		b, err := os.ReadFile(filepath.Join(m.unified, path, "cgroup.events"))
		if err != nil {
			return false, err
		}
		for _, line := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(line, "frozen "); ok {
				return strings.TrimSpace(v) == "1", nil
			}
		}
		return false, fmt.Errorf("no frozen field in %s", filepath.Join(m.unified, path, "cgroup.events"))
	}
	b, err := os.ReadFile(filepath.Join(m.v1["freezer"], path, "freezer.state"))
	if err != nil {
		return false, err
	}
	return strings.TrimSpace(string(b)) == "FROZEN", nil
}

// setFrozen freezes or thaws every task of the cgroup path by writing the
// freezer directly (no runc process: a pause costs a few syscalls). runc
// reads the same freezer, so `runc state` says "paused" afterwards and
// `runc resume` thaws. A freeze returns once every task is frozen; if that
// takes longer than freezeTimeout or ctx ends, the cgroup is thawed again.
func (m cgroupMounts) setFrozen(ctx context.Context, path string, freeze bool) error {
	file, val, err := m.freezerFile(path, freeze)
	if err != nil {
		return err
	}
	if err := os.WriteFile(file, []byte(val), 0); err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return errdefs.New(errdefs.ErrFailedPrecondition, "sandbox has no freezer cgroup %s (not started or already stopped)", filepath.Dir(file))
		}
		return fmt.Errorf("write %s: %w", file, err)
	}
	if !freeze {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, freezeTimeout)
	defer cancel()
	delay := 100 * time.Microsecond
	for {
		ok, err := m.frozen(path)
		if err != nil {
			m.thaw(path)
			return fmt.Errorf("read freezer state: %w", err)
		}
		if ok {
			return nil
		}
		if !m.v2 {
			// v1 moves from FREEZING to FROZEN only when the state is read
			// after every task froze; writing FROZEN again retries tasks
			// that were running a moment ago.
			if err := os.WriteFile(file, []byte(val), 0); err != nil {
				m.thaw(path)
				return fmt.Errorf("write %s: %w", file, err)
			}
		}
		select {
		case <-ctx.Done():
			m.thaw(path)
			return fmt.Errorf("freeze sandbox: not every task froze: %w", ctx.Err())
		case <-time.After(delay):
		}
		if delay < 10*time.Millisecond {
			delay *= 2
		}
	}
}

func (m cgroupMounts) thaw(path string) {
	if file, val, err := m.freezerFile(path, false); err == nil {
		_ = os.WriteFile(file, []byte(val), 0)
	}
}

// readKeyed returns the value of key in a flat keyed file such as
// memory.stat ("key value" lines); ok is false when the key is absent.
func readKeyed(path, key string) (int64, bool) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, false
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, key+" "); ok {
			n, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
			return n, err == nil
		}
	}
	return 0, false
}
