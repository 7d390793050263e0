package container

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kernflux/opendsec/internal/errdefs"
)

// The v2 freezer: cgroup.freeze is written and cgroup.events' "frozen" is
// awaited. A fake cgroup dir stands in for the kernel, which flips the
// event a moment later.
func TestFreezerV2(t *testing.T) {
	root := t.TempDir()
	d := filepath.Join(root, "opendsec", "sb")
	writeFiles(t, d, map[string]string{"cgroup.freeze": "0\n", "cgroup.events": "populated 1\nfrozen 0\n"})
	m := cgroupMounts{v2: true, unified: root}
	go func() {
		// The "kernel": report frozen once cgroup.freeze says 1.
		deadline := time.Now().Add(5 * time.Second)
		for time.Now().Before(deadline) {
			if b, _ := os.ReadFile(filepath.Join(d, "cgroup.freeze")); strings.TrimSpace(string(b)) == "1" {
				// Replaced atomically: the reader never sees a half-written file.
				tmp := filepath.Join(d, "events.tmp")
				os.WriteFile(tmp, []byte("populated 1\nfrozen 1\n"), 0o644)
				os.Rename(tmp, filepath.Join(d, "cgroup.events"))
				return
			}
			time.Sleep(time.Millisecond)
		}
	}()
	if err := m.setFrozen(t.Context(), "/opendsec/sb", true); err != nil {
		t.Fatal(err)
	}
	if ok, err := m.frozen("/opendsec/sb"); err != nil || !ok {
		t.Fatalf("frozen = %v, %v", ok, err)
	}
	if err := m.setFrozen(t.Context(), "/opendsec/sb", false); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(filepath.Join(d, "cgroup.freeze")); string(b) != "0" {
		t.Fatalf("cgroup.freeze = %q after thaw, want 0", b)
	}
	if err := m.setFrozen(t.Context(), "/opendsec/missing", true); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Fatalf("freeze of a missing cgroup: %v, want failed precondition", err)
	}
}

func TestFreezerV1NoController(t *testing.T) {
	m := cgroupMounts{v1: map[string]string{"memory": t.TempDir()}}
	if err := m.setFrozen(t.Context(), "/opendsec/sb", true); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Fatalf("freeze without a freezer hierarchy: %v, want failed precondition", err)
	}
}

func TestCgroupStatsLimits(t *testing.T) {
	root := t.TempDir()
	writeFiles(t, filepath.Join(root, "opendsec", "sb"), map[string]string{
		"memory.current": "1048576\n",
		"memory.max":     "134217728\n",
		"memory.stat":    "anon 100\nfile 4096\n",
		"pids.current":   "3\n",
		"pids.max":       "max\n",
		"cpu.stat":       "usage_usec 1\n",
	})
	st, err := cgroupMounts{v2: true, unified: root}.stats("/opendsec/sb")
	if err != nil {
		t.Fatal(err)
	}
	if st.MemoryLimitBytes != 128<<20 || st.MemoryCacheBytes != 4096 || st.PidsLimit != 0 {
		t.Fatalf("stats %+v: want limit 128 MiB, cache 4096, pids limit 0 (max)", st)
	}
}

// unfrozenTasks against a fake /proc: threads asleep in the freezer (v1's
// __refrigerator, v2's do_freezer_trap) and zombies are frozen; the rest is
// named with its host pid, its pid in the sandbox, command, state and
// wchan, from every cgroup under the sandbox's, running ones first; a D
// thread that is no longer D after the thaw was frozen in place.
func TestUnfrozenTasksFakeProc(t *testing.T) {
	proc, cg := t.TempDir(), t.TempDir()
	task := func(pid int, comm, state, wchan string, nspid int) {
		files := map[string]string{
			"stat":   fmt.Sprintf("%d (%s) %s 1 1 1 0 -1 4194560 0 0\n", pid, comm, state),
			"status": fmt.Sprintf("Name:\t%s\nNSpid:\t%d\t%d\n", comm, pid, nspid),
		}
		if wchan != "" {
			files["wchan"] = wchan
		}
		writeFiles(t, filepath.Join(proc, strconv.Itoa(pid)), files)
	}
	task(100, "agent", "D", "__refrigerator", 1)
	task(101, "cat", "D", "fuse_get_req", 7)
	task(102, "sleep", "S", "do_freezer_trap", 8)
	task(103, "gone", "Z", "0", 9)
	task(104, "a (b) c", "R", "0", 10) // running: no wchan
	task(105, "dd", "D", "folio_wait_bit_common", 11)
	writeFiles(t, cg, map[string]string{"tasks": "100\n101\n102\n103\n104\n999\n"}) // 999: exited meanwhile
	writeFiles(t, filepath.Join(cg, "nested"), map[string]string{"tasks": "105\n101\n"})

	got := unfrozenTasks(proc, cg, "tasks")
	want := []stuckTask{
		{pid: 104, nspid: 10, comm: "a (b) c", state: "R"}, // running first
		{pid: 101, nspid: 7, comm: "cat", state: "D", wchan: "fuse_get_req"},
		{pid: 105, nspid: 11, comm: "dd", state: "D", wchan: "folio_wait_bit_common"},
	}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("unfrozen tasks:\n got %v\nwant %v", got, want)
	}
	msg := describeStuck(got)
	for _, s := range []string{"3 not frozen", `pid 101 (pid 7 in the sandbox) "cat" state D in fuse_get_req`, `pid 104 (pid 10 in the sandbox) "a (b) c" state R;`} {
		if !strings.Contains(msg, s) {
			t.Errorf("description %q lacks %q", msg, s)
		}
	}
	// At the thaw, 105 turns out to have been frozen in place (it goes back
	// to S); 101 stays blocked (D); 104 is listed whatever it does now.
	task(105, "dd", "S", "folio_wait_bit_common", 11)
	task(104, "a (b) c", "S", "do_epoll_wait", 10)
	if got, want := stillBlocked(proc, got), want[:2]; fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("still blocked after the thaw:\n got %v\nwant %v", got, want)
	}
	many := make([]stuckTask, maxStuckListed+3)
	if msg := describeStuck(many); !strings.Contains(msg, "and 3 more") {
		t.Errorf("description of %d tasks %q does not stop at %d", len(many), msg, maxStuckListed)
	}
}

// unfrozenTasks against the real /proc names this (running, not frozen)
// process with its command and state.
func TestUnfrozenTasksSelf(t *testing.T) {
	cg := t.TempDir()
	pid := os.Getpid()
	writeFiles(t, cg, map[string]string{"cgroup.threads": strconv.Itoa(pid) + "\n"})
	got := unfrozenTasks("/proc", cg, "cgroup.threads")
	comm, err := os.ReadFile("/proc/self/comm")
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 1 || got[0].pid != pid || got[0].comm != strings.TrimSpace(string(comm)) || !strings.Contains("RSD", got[0].state) || got[0].state == "" {
		t.Fatalf("unfrozen tasks of a cgroup holding this process: %v; want pid %d %q in state R, S or D", got, pid, comm)
	}
}
