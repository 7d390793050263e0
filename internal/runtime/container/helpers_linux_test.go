package container

import (
	"bytes"
	"fmt"
	"os"
	"strconv"
	"testing"
)

// parentPid reads the parent pid of pid from /proc.
func parentPid(t testing.TB, pid int) int {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		t.Fatalf("read stat of %d: %v", pid, err)
	}
	i := bytes.LastIndexByte(b, ')')
	f := bytes.Fields(b[i+1:])
	ppid, err := strconv.Atoi(string(f[1]))
	if err != nil {
		t.Fatalf("parse ppid: %v", err)
	}
	return ppid
}
