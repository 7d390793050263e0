package vm

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/errdefs"
)

// runFile is the sandbox's persisted run state in its StateDir: which
// sandbox the directory belongs to and, once Start ran QEMU, QEMU's pid and
// start time. Recover reads it, not the Handle: the node keeps the Handle
// Create returned, made before QEMU existed (nomad's RecoverTask habit:
// what a restart needs is on disk, not in the dead process's memory).
const runFile = "vm.json"

type runState struct {
	ID  string `json:"id"`
	Pid int    `json:"pid,omitempty"`
	// StartTime is field 22 of /proc/<pid>/stat, so a reused pid is not
	// taken for this sandbox's QEMU.
	StartTime uint64 `json:"start_time,omitempty"`
	// Reclaimed: Reclaim wrote the guest's state to the sandbox's
	// reclaimDir and QEMU exited; the next Resume restores it. Pid is 0.
	Reclaimed bool `json:"reclaimed,omitempty"`
	// Args is QEMU's command line when it is not the Handle's: after a
	// reclaim the guest's RAM is a shared file of its own again.
	Args []string `json:"args,omitempty"`
}

// writeRunState replaces sd's run file atomically (a node killed while
// writing it leaves the old one or the new one).
func writeRunState(sd string, rs runState) error {
	b, _ := json.Marshal(rs)
	tmp := filepath.Join(sd, runFile+".tmp")
	f, err := os.OpenFile(tmp, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o600)
	if err != nil {
		return fmt.Errorf("vm run state: %w: %w", errdefs.ErrInternal, err)
	}
	_, err = f.Write(b)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, filepath.Join(sd, runFile))
	}
	if err != nil {
		_ = os.Remove(tmp)
		return fmt.Errorf("vm run state: %w: %w", errdefs.ErrInternal, err)
	}
	return nil
}

func readRunState(sd string) (runState, error) {
	var rs runState
	b, err := os.ReadFile(filepath.Join(sd, runFile))
	if err != nil {
		return rs, err
	}
	if err := json.Unmarshal(b, &rs); err != nil {
		return rs, fmt.Errorf("vm run state %s: %w: %w", filepath.Join(sd, runFile), errdefs.ErrInternal, err)
	}
	return rs, nil
}

// isQEMUOf says whether pid runs the QEMU of sandbox id on this node (its
// -name and RAM file; with sd, also its pidfile in sd). The process may
// still be nsenter just before its exec: its arguments are QEMU's.
func (r *Runtime) isQEMUOf(pid int, id, sd string) bool {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cmdline")
	if err != nil || len(b) == 0 {
		return false
	}
	return r.argsOf(strings.Split(strings.TrimSuffix(string(b), "\x00"), "\x00"), id, sd)
}

func (r *Runtime) argsOf(args []string, id, sd string) bool {
	name, mem, dir := false, false, sd == ""
	memArg := "mem-path=" + r.memPath(id) + ","
	for i, a := range args {
		switch {
		case a == "-name" && i+1 < len(args) && args[i+1] == "opendsec-"+id:
			name = true
		case strings.HasPrefix(a, "memory-backend-file,") && strings.Contains(a, memArg):
			mem = true
		case sd != "" && a == "-pidfile" && i+1 < len(args) && args[i+1] == filepath.Join(sd, "qemu.pid"):
			dir = true
		}
	}
	return name && mem && dir
}

// isOurQEMU says whether pid is still the QEMU of sandbox id (started at
// stime, when known).
func (r *Runtime) isOurQEMU(pid int, stime uint64, id, sd string) bool {
	if pid <= 0 || !r.isQEMUOf(pid, id, sd) {
		return false
	}
	return stime == 0 || procStartTime(pid) == stime
}

// findQEMU looks through /proc for the QEMU processes of sandbox id (in sd
// when sd is not ""): the ones no record names, as when the node died
// between QEMU's exec and the write of its run file.
func (r *Runtime) findQEMU(id, sd string) []int {
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	var pids []int
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == os.Getpid() {
			continue
		}
		if r.isQEMUOf(pid, id, sd) {
			pids = append(pids, pid)
		}
	}
	return pids
}

// stateDirOf is the StateDir of a running QEMU, from its -pidfile.
func stateDirOf(pid int) string {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cmdline")
	if err != nil {
		return ""
	}
	args := strings.Split(string(b), "\x00")
	for i, a := range args {
		if a == "-pidfile" && i+1 < len(args) {
			return filepath.Dir(args[i+1])
		}
	}
	return ""
}

// killStrays kills the QEMU processes of sandbox id that the backend does
// not hold as started (a node restart lost them) and waits until they are
// gone, so Stop and Delete never leave an orphaned VM behind.
func (r *Runtime) killStrays(ctx context.Context, id, sd string) error {
	var errs []error
	for _, pid := range r.findQEMU(id, sd) {
		if err := killAndWait(ctx, pid); err != nil {
			errs = append(errs, fmt.Errorf("vm %s qemu %d: %w", id, pid, err))
		}
	}
	return errors.Join(errs...)
}

// killAndWait sends SIGKILL through a pidfd (no reused pid is hit) and
// waits, at most 10 s, until the process has exited.
func killAndWait(ctx context.Context, pid int) error {
	fd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		if errors.Is(err, unix.ESRCH) {
			return nil
		}
		return fmt.Errorf("%w: pidfd: %w", errdefs.ErrInternal, err)
	}
	defer func() { _ = unix.Close(fd) }()
	if err := unix.PidfdSendSignal(fd, unix.SIGKILL, nil, 0); err != nil && !errors.Is(err, unix.ESRCH) {
		return fmt.Errorf("%w: kill: %w", errdefs.ErrInternal, err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
		n, err := unix.Poll(fds, 100)
		if n > 0 {
			return nil
		}
		if err != nil && !errors.Is(err, unix.EINTR) {
			return fmt.Errorf("%w: wait for its exit: %w", errdefs.ErrInternal, err)
		}
		if ctx.Err() != nil {
			return fmt.Errorf("%w: wait for its exit: %w", errdefs.ErrDeadlineExceeded, ctx.Err())
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%w: still running 10 s after SIGKILL", errdefs.ErrInternal)
		}
	}
}

// deleteUnknown is Delete of a sandbox this instance does not hold (the
// node restarted and did not Recover it): its QEMU, found by its arguments,
// is killed; the files in the StateDir that QEMU names, its RAM file and
// its cgroup go.
func (r *Runtime) deleteUnknown(ctx context.Context, id string) error {
	pids := r.findQEMU(id, "")
	var dirs []string
	for _, pid := range pids {
		if sd := stateDirOf(pid); sd != "" {
			dirs = append(dirs, sd)
		}
	}
	for _, pid := range pids {
		if err := killAndWait(ctx, pid); err != nil {
			return fmt.Errorf("vm %s delete: qemu %d: %w", id, pid, err)
		}
	}
	removeCgroup(r.cgroupPath(id))
	if err := os.Remove(r.memPath(id)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("vm %s delete memory file: %w: %w", id, errdefs.ErrInternal, err)
	}
	for _, sd := range dirs {
		if rs, err := readRunState(sd); err == nil && rs.ID != id {
			continue
		}
		for _, f := range ownedFiles {
			if err := os.Remove(filepath.Join(sd, f)); err != nil && !errors.Is(err, fs.ErrNotExist) {
				return fmt.Errorf("vm %s delete %s: %w: %w", id, f, errdefs.ErrInternal, err)
			}
		}
	}
	return nil
}

// hasDisk says whether sd still holds a sandbox's writable disk.
func hasDisk(sd string) bool {
	_, err := os.Stat(filepath.Join(sd, "rw.ext4"))
	return err == nil
}
