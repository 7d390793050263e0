package container

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/log"
	"github.com/kernflux/opendsec/internal/runtime"
)

var _ runtime.Prestarter = (*Runtime)(nil)

// prestartNice is the CPU niceness of the runc process that prestarts a
// sandbox: a warm pool refills from CPU that running sandboxes leave idle.
// Launch gives the sandbox's init back the normal priority before it runs.
const prestartNice = 19

// Prestart makes the prepared sandbox's container with `runc create`:
// namespaces, mounts, cgroups and the network namespace joined, its agent
// socket listening, and runc's init waiting for the start. Nothing of the
// sandbox runs until Launch. runc runs at low CPU priority.
func (r *Runtime) Prestart(ctx context.Context, id string) error {
	sb, err := r.lock(id)
	if err != nil {
		return err
	}
	defer sb.op.Unlock()
	if sb.phase.Load() != phasePrepared {
		return errdefs.New(errdefs.ErrFailedPrecondition, "sandbox %q was already started; only a prepared sandbox can be prestarted", id)
	}
	if sb.netNS != "" {
		if _, err := os.Stat(sb.netNS); err != nil {
			return errdefs.Invalid("network.netns", "network namespace of sandbox %s: %v; set it up before Prestart", id, err)
		}
	}
	pid, err := r.runcInit(ctx, id, sb.st.ociDir(), sb.netNS, true)
	if err != nil {
		// runc removes what it made of a container that failed; make sure.
		if _, derr := r.runcOut(context.WithoutCancel(ctx), sb.st.StateRoot, "delete", "--force", id); derr != nil && !errdefs.IsNotFound(derr) {
			log.G(ctx).Warn("remove container after failed runc create", "sandbox.id", id, "error", derr)
			sb.phase.Store(phaseLaunched) // runc may have it: Stop and Delete clean up
		}
		return fmt.Errorf("prestart sandbox: %w", err)
	}
	sb.pid.Store(int64(pid))
	sb.prestarted.Store(true)
	sb.phase.Store(phaseLaunched)
	r.watch(sb, pid)
	log.G(ctx).Debug("sandbox prestarted", "sandbox.id", id, "pid", pid)
	return nil
}

// Launch lets a prestarted sandbox run: env (K=V, on top of the image's)
// goes to its agent through the env file, which init reads and removes at
// boot; init gets the normal CPU priority back; then `runc start`.
func (r *Runtime) Launch(ctx context.Context, id string, env []string) error {
	sb, err := r.lock(id)
	if err != nil {
		return err
	}
	defer sb.op.Unlock()
	if !sb.prestarted.Load() {
		return errdefs.New(errdefs.ErrFailedPrecondition, "sandbox %q is not prestarted (or was launched already)", id)
	}
	return r.launch(ctx, sb, env)
}

// launch is Launch with sb.op held.
func (r *Runtime) launch(ctx context.Context, sb *sandbox, env []string) error {
	id := sb.id
	var b strings.Builder
	for _, e := range agentEnv(sb.guestEnv, env) {
		if strings.IndexByte(e, 0) >= 0 || !strings.Contains(e, "=") {
			return errdefs.Invalid("env", "entry %q is not K=V without NUL bytes", e)
		}
		b.WriteString(e)
		b.WriteByte(0)
	}
	if err := writeEnvFile(filepath.Join(sb.st.ociDir(), runDir), agentEnvFile, b.String()); err != nil {
		return err
	}
	// init removes its copy at boot; a ResumeFilesystem puts this one back.
	// In the bundle's tmpfs: the env often holds secrets.
	if err := writeEnvFile(launchEnvDir(sb.st.Bundle), launchEnvFile, b.String()); err != nil {
		return err
	}
	if pid := int(sb.pid.Load()); pid > 0 {
		if err := renice(pid, 0); err != nil {
			return fmt.Errorf("launch sandbox: %w", err)
		}
		if err := r.applyCPUClass(sb); err != nil {
			return fmt.Errorf("launch sandbox: %w", err)
		}
	}
	err := r.ociFor(ctx, sb.st.StateRoot, id).startCreated(ctx, filepath.Join(sb.st.StateRoot, id), int(sb.pid.Load()))
	if errors.Is(err, errNoExecFifo) {
		_, err = r.runcOut(ctx, sb.st.StateRoot, "start", id)
	}
	if err != nil {
		return fmt.Errorf("launch sandbox: %w", err)
	}
	sb.prestarted.Store(false)
	return nil
}

// execFifo is the named pipe in runc's state dir of a created container on
// whose opening runc's init waits before it execs the container's process;
// `runc start` is nothing but reading it and removing it (runc 1.0–1.2,
// libcontainer's exec()). Its absence means a runc that works otherwise.
const execFifo = "exec.fifo"

var errNoExecFifo = errors.New("no exec fifo")

// startViaExecFifo does what `runc start` does for a created container
// whose runc state dir is dir and whose init is pid, without the cost of
// starting runc (a Go binary: 5–10 ms here): it opens the exec fifo, reads
// until runc's init closes it by exec'ing the container's process, and
// removes it, after which runc reports the container running. It returns
// errNoExecFifo when dir has no fifo (the caller runs `runc start`).
func startViaExecFifo(ctx context.Context, dir string, pid int) error {
	path := filepath.Join(dir, execFifo)
	if st, err := os.Lstat(path); err != nil || st.Mode()&os.ModeNamedPipe == 0 {
		return errNoExecFifo
	}
	type opened struct {
		f   *os.File
		err error
	}
	ch := make(chan opened, 1)
	go func() {
		// Blocks until a writer opens it: runc's init already waits.
		f, err := os.OpenFile(path, os.O_RDONLY, 0)
		ch <- opened{f, err}
	}()
	// giveUp makes the open above return (init is gone, or the caller gave
	// up): it opens the fifo for writing, which succeeds once the reader
	// waits, and closes it. If init wrote meanwhile, it has exec'd: the
	// container runs, and the caller removes it like any failed launch.
	giveUp := func(err error) error {
		t := time.NewTicker(5 * time.Millisecond)
		defer t.Stop()
		for {
			if f, oerr := os.OpenFile(path, os.O_WRONLY|syscall.O_NONBLOCK, 0); oerr == nil {
				f.Close()
			}
			select {
			case o := <-ch:
				if o.f != nil {
					o.f.Close()
				}
				return err
			case <-t.C:
			}
		}
	}
	t := time.NewTicker(100 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case o := <-ch:
			if o.err != nil {
				return fmt.Errorf("open exec fifo: %w", o.err)
			}
			data, err := io.ReadAll(o.f)
			o.f.Close()
			if err != nil {
				return fmt.Errorf("read exec fifo: %w", err)
			}
			if len(data) == 0 {
				return errdefs.New(errdefs.ErrFailedPrecondition, "container init (pid %d) is gone or already started", pid)
			}
			if err := os.Remove(path); err != nil {
				return fmt.Errorf("remove exec fifo: %w", err)
			}
			return nil
		case <-t.C:
			if pid > 0 && !pidAlive(pid) {
				return giveUp(errdefs.New(errdefs.ErrFailedPrecondition, "container init (pid %d) is gone", pid))
			}
		case <-ctx.Done():
			return giveUp(fmt.Errorf("start container: %w", ctx.Err()))
		}
	}
}

// writeEnvFile creates dir/name (mode 0600) with content. Nothing of the
// sandbox has run yet, but the run dir is the sandbox's: never follow a
// link there.
func writeEnvFile(dir, name, content string) error {
	dfd, err := unix.Open(dir, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open run dir: %w", err)
	}
	defer unix.Close(dfd)
	fd, err := unix.Openat(dfd, name, unix.O_WRONLY|unix.O_CREAT|unix.O_TRUNC|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return fmt.Errorf("write agent env file: %w", err)
	}
	f := os.NewFile(uintptr(fd), name)
	if _, err := f.WriteString(content); err != nil {
		f.Close()
		return fmt.Errorf("write agent env file: %w", err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("write agent env file: %w", err)
	}
	return nil
}

// renice sets the niceness of every thread of process pid.
func renice(pid, nice int) error {
	tasks, err := os.ReadDir("/proc/" + strconv.Itoa(pid) + "/task")
	if err != nil {
		return fmt.Errorf("list threads of %d: %w", pid, err)
	}
	var errs []error
	for _, t := range tasks {
		tid, err := strconv.Atoi(t.Name())
		if err != nil {
			continue
		}
		if err := unix.Setpriority(unix.PRIO_PROCESS, tid, nice); err != nil && !errors.Is(err, unix.ESRCH) {
			errs = append(errs, fmt.Errorf("set priority of thread %d: %w", tid, err))
		}
	}
	return errors.Join(errs...)
}
