package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// memSample is the host-side memory of one idle sandbox.
type memSample struct {
	id    string
	procs int // processes in the sandbox's cgroup
	// Cgroup-accounted: what the kernel charges the sandbox (and what its
	// memory limit acts on). v1: memory.usage_in_bytes; v2: memory.current.
	cgUsage int64
	cgAnon  int64 // v1 total_rss; v2 anon
	cgFile  int64 // v1 total_cache; v2 file (page cache: overlay upper, tmpfs)
	cgKmem  int64 // v1 memory.kmem.usage_in_bytes; v2 kernel (-1 if unknown)
	// Our processes in the sandbox as seen in /proc/<pid>/status (VmRSS =
	// RssAnon + RssFile + RssShmem), summed: the container's init
	// (opendsec-init, PID 1 inside) and, when it runs, the agent server
	// (its child; it exits when idle and init starts it on demand).
	agentPid                     int
	agentRSS, agentAnon, agentFi int64
	// agentPssFile is their proportional share of the file pages they map
	// (/proc/<pid>/smaps_rollup Pss_File + Pss_Shmem): the binaries' pages
	// divided among every process that maps them.
	agentPssFile int64
	// initRSS is init's VmRSS alone; serverPid and serverRSS the server's
	// (0 when it had exited idle).
	initRSS              int64
	serverPid            int
	serverRSS            int64
	firstExecAfterSample time.Duration // one exec `true` right after sampling
}

// sampleMemory reads the memory of sandbox id, whose cgroup is
// <cgParent>/<id> and whose runc state is in stateRoot.
func sampleMemory(ctx context.Context, runc, stateRoot, cgParent string, cg cgroupInfo, id string) (memSample, error) {
	s := memSample{id: id, cgKmem: -1}
	d := filepath.Join(cg.memory, cgParent, id)
	stat, err := readKV(filepath.Join(d, "memory.stat"))
	if err != nil {
		return s, err
	}
	if cg.v2 {
		if s.cgUsage, err = readInt(filepath.Join(d, "memory.current")); err != nil {
			return s, err
		}
		s.cgAnon, s.cgFile, s.cgKmem = stat["anon"], stat["file"], stat["kernel"]
	} else {
		if s.cgUsage, err = readInt(filepath.Join(d, "memory.usage_in_bytes")); err != nil {
			return s, err
		}
		s.cgAnon, s.cgFile = stat["total_rss"], stat["total_cache"]
		if k, err := readInt(filepath.Join(d, "memory.kmem.usage_in_bytes")); err == nil {
			s.cgKmem = k
		}
	}
	if procs, err := os.ReadFile(filepath.Join(d, "cgroup.procs")); err == nil {
		s.procs = len(strings.Fields(string(procs)))
	}

	out, err := exec.CommandContext(ctx, ociBinary(runc, stateRoot, id), "--root", stateRoot, "state", id).Output()
	if err != nil {
		return s, fmt.Errorf("runc state %s (flag -state-root): %w", id, err)
	}
	var st struct {
		Pid int `json:"pid"`
	}
	if err := json.Unmarshal(out, &st); err != nil || st.Pid <= 0 {
		return s, fmt.Errorf("decode runc state of %s: %q", id, out)
	}
	s.agentPid = st.Pid
	if err := s.addProc(st.Pid); err != nil {
		return s, err
	}
	s.initRSS = s.agentRSS
	if s.serverPid = serverOf(st.Pid); s.serverPid > 0 {
		before := s.agentRSS
		if err := s.addProc(s.serverPid); err != nil {
			return s, err
		}
		s.serverRSS = s.agentRSS - before
	}
	return s, nil
}

// addProc adds pid's resident memory to the sample.
func (s *memSample) addProc(pid int) error {
	status, err := readKV(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return err
	}
	// /proc/<pid>/status reports kB.
	s.agentRSS += status["VmRSS:"] << 10
	s.agentAnon += status["RssAnon:"] << 10
	s.agentFi += status["RssFile:"] << 10
	rollup, err := readKV(fmt.Sprintf("/proc/%d/smaps_rollup", pid))
	if err != nil {
		return err
	}
	s.agentPssFile += (rollup["Pss_File:"] + rollup["Pss_Shmem:"]) << 10
	return nil
}

// serverOf is the agent server running under init (its child named
// "agent"), or 0.
func serverOf(initPid int) int {
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		b, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue
		}
		i, j := strings.IndexByte(string(b), '('), strings.LastIndexByte(string(b), ')')
		if i < 0 || j < i {
			continue
		}
		f := strings.Fields(string(b[j+1:]))
		if len(f) > 1 && f[1] == strconv.Itoa(initPid) && string(b[i+1:j]) == "agent" && f[0] != "Z" {
			pid, _ := strconv.Atoi(e.Name())
			return pid
		}
	}
	return 0
}

func readInt(path string) (int64, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, fmt.Errorf("read %s: %w", path, err)
	}
	v, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	if err != nil {
		return 0, fmt.Errorf("parse %s: %w", path, err)
	}
	return v, nil
}

// readKV reads "key value [unit]" lines; unparsable values are skipped.
func readKV(path string) (map[string]int64, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", path, err)
	}
	defer f.Close()
	m := map[string]int64{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fs := strings.Fields(sc.Text())
		if len(fs) < 2 {
			continue
		}
		if v, err := strconv.ParseInt(fs[1], 10, 64); err == nil {
			m[fs[0]] = v
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("read %s: %w", path, err)
	}
	return m, nil
}

// memAvailable is the host's MemAvailable (/proc/meminfo) in bytes.
func memAvailable() (int64, error) {
	m, err := readKV("/proc/meminfo")
	if err != nil {
		return 0, err
	}
	v, ok := m["MemAvailable:"]
	if !ok {
		return 0, fmt.Errorf("no MemAvailable in /proc/meminfo")
	}
	return v << 10, nil
}

// ociBinary is the OCI runtime that made container id under stateRoot:
// crun when its state file (status) is there (the node's default where crun
// works), else runc.
func ociBinary(runc, stateRoot, id string) string {
	if _, err := os.Stat(filepath.Join(stateRoot, id, "status")); err == nil {
		return "crun"
	}
	return runc
}
