package vm

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime/vmm"
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
	if err := vmm.WriteRunFile(filepath.Join(sd, runFile), rs); err != nil {
		return fmt.Errorf("vm run state: %w: %w", errdefs.ErrInternal, err)
	}
	return nil
}

func readRunState(sd string) (runState, error) {
	var rs runState
	err := vmm.ReadRunFile(filepath.Join(sd, runFile), &rs)
	return rs, err
}

// argsOf says whether args are those of the QEMU of sandbox id on this
// node (its -name and RAM file; with sd, also its pidfile in sd). The
// process may still be nsenter just before its exec: its arguments are
// QEMU's.
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
	return vmm.Is(pid, stime, func(args []string) bool { return r.argsOf(args, id, sd) })
}

// findQEMU looks through /proc for the QEMU processes of sandbox id (in sd
// when sd is not ""): the ones no record names, as when the node died
// between QEMU's exec and the write of its run file.
func (r *Runtime) findQEMU(id, sd string) []int {
	return vmm.Find(func(args []string) bool { return r.argsOf(args, id, sd) })
}

// stateDirOf is the StateDir of a running QEMU, from its -pidfile.
func stateDirOf(pid int) string {
	args := vmm.Cmdline(pid)
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
		if err := vmm.KillAndWait(ctx, pid, killWait); err != nil {
			errs = append(errs, fmt.Errorf("vm %s qemu %d: %w", id, pid, err))
		}
	}
	return errors.Join(errs...)
}

// killWait bounds the wait for a QEMU killed by Stop or Delete.
const killWait = 10 * time.Second

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
		if err := vmm.KillAndWait(ctx, pid, killWait); err != nil {
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
