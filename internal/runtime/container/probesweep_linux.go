package container

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// The crun probe's names: its bundle dir in the temp dir is
// probeDirPrefix<node pid>.<random>, its container and cgroup
// probeIDPrefix<node pid>, beside the sandboxes' cgroup parent.
const (
	probeDirPrefix = "opendsec-crun-probe."
	probeIDPrefix  = "opendsec-probe-"
)

// sweepProbes removes what the probes of node processes that are gone
// left behind: a node that died between its probe's create and delete
// left the bundle dir, the created container (its init alive in the
// created state, holding whatever descriptors it inherited) and its
// cgroups. Probes of a process still alive (another node on this host
// probing now) are left alone, as are names it cannot read a pid from.
// It is best effort: the probe that follows does not depend on it. It
// returns how many leftover probe containers and cgroups it removed.
func (o *ociRuntime) sweepProbes(cfg *Config, cg cgroupMounts) int {
	n := 0
	dirs, _ := filepath.Glob(filepath.Join(os.TempDir(), probeDirPrefix+"*"))
	for _, dir := range dirs {
		pid, ok := probeDirPid(dir)
		if !ok || processAlive(pid) {
			continue
		}
		root := filepath.Join(dir, "state")
		ents, _ := os.ReadDir(root)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		run := o.probeRunner(ctx, dir, root)
		removed := true
		for _, e := range ents {
			if !e.IsDir() {
				continue
			}
			if err := run("delete", "--force", e.Name()); err != nil {
				removed = false // its state stays for the next node
				continue
			}
			n++
		}
		cancel()
		if removed {
			_ = os.RemoveAll(dir)
		}
	}
	// The probe's cgroups: crun's delete removed those of a container it
	// still knew; these are the ones of a container whose state was gone
	// (empty, or rmdir fails and they stay).
	parent := filepath.Dir(cfg.CgroupParent)
	seen := map[string]bool{}
	for _, d := range cg.dirs(parent) {
		ents, _ := os.ReadDir(d)
		for _, e := range ents {
			pid, ok := probeIDPid(e.Name())
			if !e.IsDir() || !ok || processAlive(pid) {
				continue
			}
			if unix.Rmdir(filepath.Join(d, e.Name())) == nil && !seen[e.Name()] {
				seen[e.Name()] = true
				n++
			}
		}
	}
	for id := range seen {
		_ = o.dropHidden(filepath.Join(parent, id), parent)
	}
	return n
}

// probeDirPid reads the node pid out of a probe bundle dir's name
// (probeDirPrefix<pid>.<random>); false for any other name, such as the
// pid-less ones nodes made before the pid was in it.
func probeDirPid(dir string) (int, bool) {
	rest, ok := strings.CutPrefix(filepath.Base(dir), probeDirPrefix)
	if !ok {
		return 0, false
	}
	p, _, ok := strings.Cut(rest, ".")
	if !ok {
		return 0, false
	}
	return positivePid(p)
}

// probeIDPid reads the node pid out of a probe container's id.
func probeIDPid(id string) (int, bool) {
	p, ok := strings.CutPrefix(id, probeIDPrefix)
	if !ok {
		return 0, false
	}
	return positivePid(p)
}

func positivePid(s string) (int, bool) {
	pid, err := strconv.Atoi(s)
	return pid, err == nil && pid > 0
}

// processAlive reports whether a process pid exists (or may: EPERM, and
// any error but ESRCH, count as alive, so nothing of it is touched).
func processAlive(pid int) bool {
	return !errors.Is(unix.Kill(pid, 0), unix.ESRCH)
}
