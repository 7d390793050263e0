package main

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// clockTick is USER_HZ, the unit of /proc's CPU times (100 on every Linux
// architecture Go supports).
const clockTick = 100

// cpuTimes is CPU time in milliseconds, from /proc.
type cpuTimes struct {
	// Self is utime+stime of the process; Children is cutime+cstime (the
	// children it waited for, e.g. `runc run`).
	Self, Children float64
	// HostBusy is the whole machine's non-idle time (all CPUs, /proc/stat).
	HostBusy float64
}

// readCPU reads pid's times and the host's (pid 0: the host's only).
func readCPU(pid int) (cpuTimes, error) {
	var t cpuTimes
	if pid > 0 {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			return t, fmt.Errorf("read cpu time of pid %d: %w", pid, err)
		}
		// The fields after the command (which may hold spaces), from
		// field 3 (state) on: utime is field 14, stime 15, cutime 16, cstime 17.
		s := string(b)
		f := strings.Fields(s[strings.LastIndexByte(s, ')')+2:])
		if len(f) < 15 {
			return t, fmt.Errorf("parse /proc/%d/stat: %d fields", pid, len(f))
		}
		var v [4]float64
		for i := range v {
			n, err := strconv.ParseFloat(f[11+i], 64)
			if err != nil {
				return t, fmt.Errorf("parse /proc/%d/stat: %w", pid, err)
			}
			v[i] = n * 1000 / clockTick
		}
		t.Self, t.Children = v[0]+v[1], v[2]+v[3]
	}
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return t, fmt.Errorf("read /proc/stat: %w", err)
	}
	line, _, _ := strings.Cut(string(b), "\n")
	f := strings.Fields(line) // cpu user nice system idle iowait irq softirq steal ...
	for i := 1; i < len(f) && i <= 8; i++ {
		if i == 4 || i == 5 {
			continue // idle, iowait
		}
		n, err := strconv.ParseFloat(f[i], 64)
		if err != nil {
			return t, fmt.Errorf("parse /proc/stat: %w", err)
		}
		t.HostBusy += n * 1000 / clockTick
	}
	return t, nil
}

func (t cpuTimes) sub(u cpuTimes) cpuTimes {
	return cpuTimes{Self: t.Self - u.Self, Children: t.Children - u.Children, HostBusy: t.HostBusy - u.HostBusy}
}

// inodesUsed is the number of inodes in use on the file system of the dir
// of nodeLog (the node's data dir).
func inodesUsed(nodeLog string) (int64, error) {
	if nodeLog == "" {
		return 0, fmt.Errorf("no -node-log")
	}
	return fsInodesUsed(filepath.Dir(nodeLog))
}
