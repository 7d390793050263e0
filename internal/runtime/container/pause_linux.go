package container

import (
	"context"
	"errors"
	"fmt"
	iofs "io/fs"
	"os"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/fsutil"
	"github.com/kernflux/opendsec/internal/log"
	"github.com/kernflux/opendsec/internal/runtime"
)

// Pause freezes every process of the sandbox with the cgroup freezer.
// Pausing a paused sandbox succeeds.
func (r *Runtime) Pause(ctx context.Context, id string) error {
	return r.setFrozen(ctx, id, true)
}

// Resume thaws a paused sandbox. Resuming a running sandbox succeeds.
func (r *Runtime) Resume(ctx context.Context, id string) error {
	return r.setFrozen(ctx, id, false)
}

// setFrozen freezes or thaws a started sandbox, under its lifecycle lock.
func (r *Runtime) setFrozen(ctx context.Context, id string, frozen bool) error {
	sb, err := r.lock(id)
	if err != nil {
		return err
	}
	defer sb.op.Unlock()
	if err := r.running(sb); err != nil {
		return err
	}
	if !frozen && !r.cg.v2 {
		// A Reclaim cut short by a node kill left the limit lowered.
		if err := r.restoreMemoryLimit(ctx, sb); err != nil {
			return fmt.Errorf("resume sandbox %s: %w", id, err)
		}
	}
	if err := r.cg.setFrozen(ctx, sb.st.CgroupPath, frozen); err != nil {
		verb := "resume"
		if frozen {
			verb = "pause"
		}
		return fmt.Errorf("%s sandbox %s: %w", verb, id, err)
	}
	return nil
}

// running returns a failed-precondition error unless sb's init was started
// and is still alive (a frozen init is alive).
func (r *Runtime) running(sb *sandbox) error {
	if sb.phase.Load() != phaseLaunched {
		return errdefs.New(errdefs.ErrFailedPrecondition, "sandbox %q is not running (not started, or stopped)", sb.id)
	}
	if pid := int(sb.pid.Load()); pid > 0 && !pidAlive(pid) {
		return errdefs.New(errdefs.ErrFailedPrecondition, "sandbox %q is stopped", sb.id)
	}
	return nil
}

// Stats reads memory, cpu and pids use from the sandbox's cgroup and the
// size of its writable layer.
func (r *Runtime) Stats(ctx context.Context, id string) (runtime.Stats, error) {
	sb, err := r.get(id)
	if err != nil {
		return runtime.Stats{}, err
	}
	var st runtime.Stats
	// A sandbox paused with only its files runs nothing and has no
	// cgroups: only its files count.
	if sb.phase.Load() != phaseFSPaused {
		st, err = r.cg.stats(sb.st.CgroupPath)
		if errors.Is(err, os.ErrNotExist) {
			return st, errdefs.New(errdefs.ErrFailedPrecondition, "sandbox %q has no cgroup (not started or already deleted)", id)
		}
		if err != nil {
			return st, fmt.Errorf("sandbox stats: %w", err)
		}
	}
	if d := sb.st.Disk; d != nil {
		// The quota's own accounting: no walk.
		u, err := r.quotaOf(d).usage(sb.st.Bundle, d)
		if err != nil {
			return st, fmt.Errorf("sandbox disk use: %w", err)
		}
		st.DiskUsedBytes, st.DiskTotalBytes, st.DiskMeasuredAt = u.Bytes, u.BytesLimit, time.Now().UTC()
		st.DiskInodes, st.DiskInodesLimit = u.Inodes, u.InodesLimit
		return st, nil
	}
	st.DiskUsedBytes, st.DiskTotalBytes, st.DiskMeasuredAt = sb.disk.get(ctx, sb.st.upper())
	return st, nil
}

// Measuring the writable layer means walking every file in it, which costs
// time in proportion to the files: a sandbox with a million files would
// make every metrics call take seconds. So each sandbox caches its last
// measurement for diskTTLFactor times what the walk took (a small layer is
// measured afresh at almost every call, a huge one at most every
// diskMaxTTL), runs at most one walk at a time, and a caller waits at most
// diskWait for a walk before it takes the cached value (with its time).
const (
	diskMaxTTL    = 10 * time.Second
	diskTTLFactor = 50
	diskWait      = 500 * time.Millisecond
	// diskWalkLimit stops a walk; its partial sum (a lower bound) is kept
	// for diskPartialTTL.
	diskWalkLimit  = time.Minute
	diskPartialTTL = 10 * time.Minute
)

// diskCache is one sandbox's cached disk measurement.
type diskCache struct {
	mu          sync.Mutex
	used, total int64         // guarded by mu
	at          time.Time     // when used and total were measured; zero: never
	ttl         time.Duration // how long they are used after at
	walking     chan struct{} // closed when the walk in progress ends; nil if none
}

// get returns the cached measurement of dir if it is fresh; otherwise it
// starts a walk (unless one runs) and waits for it up to diskWait or ctx,
// then returns what the cache holds.
func (c *diskCache) get(ctx context.Context, dir string) (used, total int64, at time.Time) {
	c.mu.Lock()
	if !c.at.IsZero() && time.Since(c.at) < c.ttl {
		defer c.mu.Unlock()
		return c.used, c.total, c.at
	}
	done := c.walking
	if done == nil {
		done = make(chan struct{})
		c.walking = done
		go c.walk(dir, done)
	}
	c.mu.Unlock()
	t := time.NewTimer(diskWait)
	defer t.Stop()
	select {
	case <-done:
	case <-t.C:
	case <-ctx.Done():
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.used, c.total, c.at
}

// walk measures dir into the cache and closes done.
func (c *diskCache) walk(dir string, done chan struct{}) {
	start := time.Now()
	used, total, complete := diskUsage(dir, start.Add(diskWalkLimit))
	ttl := diskTTL(time.Since(start), complete)
	if !complete {
		log.G(context.Background()).Warn("disk usage walk of a sandbox's writable layer stopped at its time limit; its disk use is a lower bound",
			"dir", dir, "limit", diskWalkLimit, "used_bytes", used)
	}
	c.mu.Lock()
	c.used, c.total, c.at, c.ttl = used, total, start.UTC(), ttl
	c.walking = nil
	c.mu.Unlock()
	close(done)
}

// diskTTL is how long a measurement that took cost is used.
func diskTTL(cost time.Duration, complete bool) time.Duration {
	if !complete {
		return diskPartialTTL
	}
	return min(cost*diskTTLFactor, diskMaxTTL)
}

// diskWalkHook, if set, runs for each entry the walk visits (tests).
var diskWalkHook func(rel string)

// diskUsage returns the bytes allocated to files under dir (hard links
// counted once) and the size of the filesystem that holds it. complete is
// false when the walk stopped at deadline (used is then a lower bound).
//
// dir is a live sandbox's upper layer, which the sandbox may change during
// the walk: the walk never follows a symlink (a directory swapped for a
// symlink to / is skipped, not walked), so it never measures host files.
func diskUsage(dir string, deadline time.Time) (used, total int64, complete bool) {
	var fs unix.Statfs_t
	if unix.Statfs(dir, &fs) == nil {
		total = int64(fs.Blocks) * fs.Bsize
	}
	ctx, cancel := context.WithDeadline(context.Background(), deadline)
	defer cancel()
	type ino struct{ dev, ino uint64 }
	seen := map[ino]bool{}
	err := fsutil.WalkNoFollowSkipChanged(ctx, dir, func(rel, _ string, fi iofs.FileInfo) error {
		if diskWalkHook != nil {
			diskWalkHook(rel)
		}
		st, ok := fi.Sys().(*syscall.Stat_t)
		if !ok {
			return nil
		}
		if st.Nlink > 1 && !fi.IsDir() {
			k := ino{st.Dev, st.Ino}
			if seen[k] {
				return nil
			}
			seen[k] = true
		}
		used += st.Blocks * 512
		return nil
	})
	if err != nil && !errors.Is(err, context.DeadlineExceeded) {
		log.G(ctx).Debug("disk usage walk of a sandbox's writable layer ended early; its disk use is a lower bound", "dir", dir, "error", err)
	}
	return used, total, !errors.Is(err, context.DeadlineExceeded)
}
