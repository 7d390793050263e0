package container

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/log"
	"github.com/kernflux/opendsec/internal/osthread"
)

// crun 1.8 on a hybrid host, run where the cgroup2 mount is unmounted
// (inCgroupView), takes the bare directory left under the mount point for
// the cgroup2 hierarchy: for every container it makes
// <cgroup path>/cgroup.procs there, on the tmpfs of /sys/fs/cgroup, and
// never removes it. Hidden under the real cgroup2 mount in every other
// view, those would pile up by one directory and one file per sandbox
// ever made. hiddenDir is that bare directory, opened once where it is
// visible; the node removes a container's leftovers through it after
// crun deleted the container (dropHidden) and sweeps what earlier runs
// left when it starts (sweepHidden).

// openHiddenDir opens the directory under the hybrid host's cgroup2 mount
// point (o.hideUnified), where crun's commands saw it before they ran
// with a view of their own (cgview_linux.go), if it is on a tmpfs (nil,
// nil when it is not: nothing of crun's can be there). It is opened where
// only that mount is gone: crun's view has no such directory.
func (o *ociRuntime) openHiddenDir() (*os.File, error) {
	var f *os.File
	c := make(chan error, 1)
	osthread.Throwaway(func() {
		if err := unshareView(cgroupView{unified: o.hideUnified}); err != nil {
			c <- err
			return
		}
		d, err := os.OpenFile(o.hideUnified, os.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW, 0)
		if err != nil {
			c <- fmt.Errorf("open the directory under %s: %w", o.hideUnified, err)
			return
		}
		var st unix.Statfs_t
		if err := unix.Fstatfs(int(d.Fd()), &st); err != nil || st.Type != unix.TMPFS_MAGIC {
			_ = d.Close()
			c <- err
			return
		}
		f = d
		c <- nil
	})
	return f, <-c
}

// dropHidden removes crun's leftovers of the container in cgroupPath: its
// cgroup.procs file and directory under the hidden cgroup2 mount point,
// then the parents it leaves empty up to (not including) keep.
func (o *ociRuntime) dropHidden(cgroupPath, keep string) error {
	if o == nil || o.hidden == nil {
		return nil
	}
	rel := strings.Trim(filepath.Clean("/"+cgroupPath), "/")
	if rel == "" {
		return nil
	}
	fd := int(o.hidden.Fd())
	if err := unix.Unlinkat(fd, rel+"/cgroup.procs", 0); err != nil && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("remove crun's hidden %s/cgroup.procs: %w", rel, err)
	}
	stop := strings.Trim(filepath.Clean("/"+keep), "/")
	for d := rel; d != "." && d != "" && d != stop; d = filepath.Dir(d) {
		if err := unix.Unlinkat(fd, d, unix.AT_REMOVEDIR); err != nil {
			if errors.Is(err, unix.ENOENT) {
				continue
			}
			if errors.Is(err, unix.ENOTEMPTY) || errors.Is(err, unix.EEXIST) {
				return nil
			}
			return fmt.Errorf("remove crun's hidden %s: %w", d, err)
		}
	}
	return nil
}

// sweepHidden removes crun's leftovers of every container under parent
// (a cgroup path) that live does not name: what node runs before this one
// left. It returns how many containers' leftovers it removed.
func (o *ociRuntime) sweepHidden(parent string, live func(id string) bool) (int, error) {
	if o == nil || o.hidden == nil {
		return 0, nil
	}
	rel := strings.Trim(filepath.Clean("/"+parent), "/")
	if rel == "" {
		return 0, nil
	}
	dfd, err := unix.Openat(int(o.hidden.Fd()), rel, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if errors.Is(err, unix.ENOENT) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("open crun's hidden %s: %w", rel, err)
	}
	d := os.NewFile(uintptr(dfd), rel)
	defer func() { _ = d.Close() }()
	names, err := d.Readdirnames(-1)
	if err != nil {
		return 0, fmt.Errorf("list crun's hidden %s: %w", rel, err)
	}
	n := 0
	var errs []error
	for _, id := range names {
		if live(id) {
			continue
		}
		if err := o.dropHidden(rel+"/"+id, rel); err != nil {
			errs = append(errs, err)
			continue
		}
		n++
	}
	return n, errors.Join(errs...)
}

// sweepHiddenAtStart removes, in the background, crun's leftovers of
// containers under the sandboxes' cgroup parent that no longer have a
// state in the state root (made by earlier node runs).
func (r *Runtime) sweepHiddenAtStart(ctx context.Context) {
	if r.oci.hidden == nil {
		return
	}
	go func() {
		n, err := r.oci.sweepHidden(r.cfg.CgroupParent, func(id string) bool {
			_, err := os.Lstat(filepath.Join(r.cfg.StateRoot, id))
			return err == nil
		})
		if err != nil {
			log.G(ctx).Warn("crun's leftovers under the hidden cgroup2 mount point: some were not removed", log.Err(err))
		}
		if n > 0 {
			log.G(ctx).Info("removed crun's leftovers under the hidden cgroup2 mount point", "containers", n, "cgroup_parent", r.cfg.CgroupParent)
		}
	}()
}
