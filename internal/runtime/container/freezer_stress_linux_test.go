package container

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/osthread"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/runtime/runtimetest"
	"github.com/kernflux/opendsec/internal/testutil"
)

// freezerState reads the freezer of the cgroup path as v1 names it:
// THAWED, FREEZING or FROZEN (on v2 from cgroup.freeze and cgroup.events).
func freezerState(t testing.TB, m cgroupMounts, path string) string {
	t.Helper()
	if !m.v2 {
		s, err := m.v1State(path)
		if err != nil {
			t.Fatalf("read freezer.state: %v", err)
		}
		return s
	}
	b, err := os.ReadFile(filepath.Join(m.unified, path, "cgroup.freeze"))
	if err != nil {
		t.Fatalf("read cgroup.freeze: %v", err)
	}
	frozen, err := m.frozen(path)
	if err != nil {
		t.Fatalf("read cgroup.events: %v", err)
	}
	switch want := strings.TrimSpace(string(b)) == "1"; {
	case want && frozen:
		return "FROZEN"
	case !want && !frozen:
		return "THAWED"
	}
	return "FREEZING"
}

// busyWorkload starts, inside sandbox id, a shell that forks a short-lived
// child without pause (counting them in /forks) and a loop writing and
// fsyncing a file (I/O, tasks in D state), and waits until both run.
func busyWorkload(t *testing.T, rt runtime.Runtime, id string) {
	t.Helper()
	res := sh(t, rt, id, `
(n=0; while :; do /bin/true; ( : ); n=$((n+1)); echo $n > /forks; done) >/dev/null 2>&1 </dev/null &
(while :; do dd if=/dev/zero of=/io bs=64k count=16 conv=fsync 2>/dev/null; echo x >> /ios; done) >/dev/null 2>&1 </dev/null &
`)
	if res.ExitCode != 0 {
		t.Fatalf("start workload: %+v", res)
	}
	waitCounter(t, rt, id, "/forks", 1)
	waitFile(t, rt, id, "/ios")
}

// counter reads a number the workload keeps in file (0 if not there yet).
func counter(t *testing.T, rt runtime.Runtime, id, file string) int {
	t.Helper()
	res := sh(t, rt, id, "cat "+file+" 2>/dev/null")
	n, _ := strconv.Atoi(strings.TrimSpace(res.Stdout))
	return n
}

// waitCounter polls until the number in file reaches at least n.
func waitCounter(t *testing.T, rt runtime.Runtime, id, file string, n int) int {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		if c := counter(t, rt, id, file); c >= n {
			return c
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s in sandbox did not reach %d in 20 s", file, n)
		}
		time.Sleep(20 * time.Millisecond) // polling a condition with a deadline
	}
}

func waitFile(t *testing.T, rt runtime.Runtime, id, file string) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for sh(t, rt, id, "test -s "+file).ExitCode != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("%s did not appear in the sandbox in 20 s", file)
		}
		time.Sleep(20 * time.Millisecond) // polling a condition with a deadline
	}
}

// pauseLoop pauses and resumes sandbox id n times and checks every pause
// succeeds with the cgroup FROZEN, and every resume leaves it THAWED. It
// returns each pause's duration and the thaw-and-retry rounds seen.
func pauseLoop(t *testing.T, c *Runtime, id string, n int) (took []time.Duration, thaws, polls int) {
	t.Helper()
	sb, err := c.get(id)
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	onFreeze = func(st freezeStats) {
		mu.Lock()
		thaws += st.thaws
		polls += st.polls
		mu.Unlock()
	}
	t.Cleanup(func() { onFreeze = nil })
	for i := range n {
		// Land the freeze at a random point of the workload.
		time.Sleep(time.Duration(rand.IntN(5000)) * time.Microsecond)
		t0 := time.Now()
		if err := c.Pause(t.Context(), id); err != nil {
			t.Fatalf("pause %d of %d: %v", i+1, n, err)
		}
		took = append(took, time.Since(t0))
		if s := freezerState(t, c.cg, sb.st.CgroupPath); s != "FROZEN" {
			t.Fatalf("freezer after pause %d: %s, want FROZEN", i+1, s)
		}
		if err := c.Resume(t.Context(), id); err != nil {
			t.Fatalf("resume %d of %d: %v", i+1, n, err)
		}
		if s := freezerState(t, c.cg, sb.st.CgroupPath); s != "THAWED" {
			t.Fatalf("freezer after resume %d: %s, want THAWED", i+1, s)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	return took, thaws, polls
}

func percentile(d []time.Duration, p float64) time.Duration {
	s := slices.Clone(d)
	slices.Sort(s)
	return s[min(len(s)-1, int(float64(len(s))*p))]
}

// A sandbox that forks without pause and does I/O is paused and resumed
// many times; every pause freezes it whole and every resume thaws it, and
// it runs on afterwards.
func TestPauseForkingSandbox(t *testing.T) {
	f := newFactory(t)
	rt, tmpl := f(t)
	spec, _ := runtimetest.StartSandbox(t, rt, tmpl)
	busyWorkload(t, rt, spec.ID)
	took, thaws, polls := pauseLoop(t, rt.(*Runtime), spec.ID, 30)
	t.Logf("30 pauses: p50 %s, max %s; %d thaw-and-retry rounds, %d state reads not frozen",
		percentile(took, 0.5), percentile(took, 1), thaws, polls)
	before := counter(t, rt, spec.ID, "/forks")
	waitCounter(t, rt, spec.ID, "/forks", before+10) // and it forks again
}

// The pause loop beside a CPU and I/O hog on the host (two `yes` and a
// goroutine writing and fsyncing), with the forking, writing workload in
// the sandbox: every pause succeeds. 20 iterations by default;
// OPENDSEC_PAUSE_LOOP=200 runs 200.
func TestPauseLoopBesideHogs(t *testing.T) {
	n := 20
	if s := os.Getenv("OPENDSEC_PAUSE_LOOP"); s != "" {
		v, err := strconv.Atoi(s)
		if err != nil || v < 1 {
			t.Fatalf("OPENDSEC_PAUSE_LOOP=%q: want a positive count", s)
		}
		n = v
	}
	f := newFactory(t)
	rt, tmpl := f(t)
	spec, _ := runtimetest.StartSandbox(t, rt, tmpl)
	busyWorkload(t, rt, spec.ID)
	hogs(t)
	took, thaws, polls := pauseLoop(t, rt.(*Runtime), spec.ID, n)
	t.Logf("%d pauses beside hogs: p50 %s, p99 %s, max %s; %d thaw-and-retry rounds, %d state reads not frozen",
		n, percentile(took, 0.5), percentile(took, 0.99), percentile(took, 1), thaws, polls)
}

// hogs starts two CPU hogs (`yes`, killed by PID at the end) and an I/O hog
// (a goroutine writing and fsyncing a file) for the rest of the test.
func hogs(t *testing.T) {
	t.Helper()
	for range 2 {
		cmd := exec.Command("yes")
		if err := cmd.Start(); err != nil { // stdout is /dev/null
			t.Fatal(err)
		}
		t.Cleanup(func() {
			cmd.Process.Kill()
			cmd.Wait()
		})
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	t.Cleanup(func() { cancel(); <-done })
	path := filepath.Join(t.TempDir(), "iohog")
	go func() {
		defer close(done)
		buf := make([]byte, 1<<20)
		f, err := os.Create(path)
		if err != nil {
			return
		}
		defer f.Close()
		for i := 0; ctx.Err() == nil; i++ {
			if i%32 == 0 {
				f.Truncate(0)
				f.Seek(0, io.SeekStart)
			}
			f.Write(buf)
			f.Sync()
		}
	}()
}

// A freeze that cannot complete ends at the caller's deadline, or at
// freezeTimeout, with the cgroup thawed again and an error naming the stuck
// task (pid, state, wchan) but not the task that froze; once the task is
// released the freeze works. The stuck task: mkdir in the root of a FUSE
// mount whose server never answers, while another task's lookup there
// waits for the server holding the directory's lock. The lookup's wait is
// freezable since Linux 6.1 (it freezes where it is); the mkdir's wait for
// the lock (D, in rwsem_down_write_slowpath) is not, on any kernel.
func TestFreezeFailureNamesStuckTask(t *testing.T) {
	testutil.RequiresRoot(t)
	m, err := detectCgroups()
	if err != nil {
		t.Fatal(err)
	}
	path := "/opendsec-test/" + runtimetest.NewID("freeze")
	dir := filepath.Join(m.unified, path)
	if !m.v2 {
		dir = filepath.Join(m.v1["freezer"], path)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		m.thaw(path)
		if err := m.remove(context.Background(), path); err != nil {
			t.Errorf("remove test cgroup: %v", err)
		}
	})
	sleeper := startInCgroup(t, dir, nil, "sleep", "1000")
	fuse, mnt := fuseWithoutServer(t)
	lookup := startInCgroup(t, dir, fuse, "cat", filepath.Join(mnt, "x"))
	t.Cleanup(func() { m.thaw(path) }) // before the kills: a frozen task does not die
	waitBlocked(t, lookup, "cat")
	stuck := startInCgroup(t, dir, fuse, "mkdir", filepath.Join(mnt, "y"))
	waitBlocked(t, stuck, "mkdir")

	check := func(err error, what string) {
		t.Helper()
		if err == nil {
			t.Fatalf("%s: freeze with a task blocked on FUSE succeeded", what)
		}
		t.Logf("%s: %v", what, err)
		msg := err.Error()
		for _, s := range []string{fmt.Sprintf("pid %d ", stuck), `"mkdir" state D in `, "thawed again", "retry the pause"} {
			if !strings.Contains(msg, s) {
				t.Errorf("%s: error %q does not say %q", what, msg, s)
			}
		}
		if strings.Contains(msg, fmt.Sprintf("pid %d ", sleeper)) { // frozen (in __refrigerator, or in place in nanosleep)
			t.Errorf("%s: error %q names the sleeper %d, which froze", what, msg, sleeper)
		}
		if strings.Contains(msg, dir) {
			t.Errorf("%s: error %q names the host cgroup directory", what, msg)
		}
		if s := freezerState(t, m, path); s != "THAWED" {
			t.Errorf("%s: freezer after the failed freeze: %s, want THAWED", what, s)
		}
	}
	ctx, cancel := context.WithTimeout(t.Context(), 300*time.Millisecond)
	err = m.setFrozen(ctx, path, true)
	cancel()
	check(err, "caller's deadline")
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("error past the caller's deadline %v: want it to wrap context.DeadlineExceeded", err)
	}

	defer func(d time.Duration) { freezeTimeout = d }(freezeTimeout)
	freezeTimeout = 500 * time.Millisecond
	err = m.setFrozen(t.Context(), path, true)
	check(err, "freeze budget")
	if !errors.Is(err, errdefs.ErrUnavailable) {
		t.Errorf("error past the freeze budget %v: want unavailable", err)
	}

	// Abort the FUSE connection: the lookup fails and cat exits, mkdir gets
	// the lock, fails and exits; the rest freezes.
	if err := fuse.Close(); err != nil {
		t.Fatal(err)
	}
	if err := m.setFrozen(t.Context(), path, true); err != nil {
		t.Fatalf("freeze after the stuck task was released: %v", err)
	}
	if s := freezerState(t, m, path); s != "FROZEN" {
		t.Fatalf("freezer after freeze: %s, want FROZEN", s)
	}
	if err := m.setFrozen(t.Context(), path, false); err != nil {
		t.Fatal(err)
	}
}

// startInCgroup starts argv in the cgroup directory dir (the process waits
// for a line on stdin, sent once its pid is in cgroup.procs) and returns its
// pid; it is killed and reaped at the end of the test. With fuse set it is
// started from fuseThread's mount namespace.
func startInCgroup(t *testing.T, dir string, fuse *fuseMount, argv ...string) int {
	t.Helper()
	cmd := exec.Command("/bin/sh", "-c", `read x; exec "$@"`, "sh")
	cmd.Args = append(cmd.Args, argv...)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	if fuse != nil {
		err = fuse.start(cmd)
	} else {
		err = cmd.Start()
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
	})
	pid := cmd.Process.Pid
	if err := os.WriteFile(filepath.Join(dir, "cgroup.procs"), []byte(strconv.Itoa(pid)), 0); err != nil {
		t.Fatal(err)
	}
	if _, err := io.WriteString(stdin, "go\n"); err != nil {
		t.Fatal(err)
	}
	return pid
}

// waitBlocked waits until pid, running comm, sleeps uninterruptibly (D)
// outside the freezer.
func waitBlocked(t *testing.T, pid int, comm string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		task, ok := readTask("/proc", pid)
		if ok && task.state == "D" && !task.frozen() && task.comm == comm {
			t.Logf("blocked task: %v", task)
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("pid %d is not blocked in the kernel after 10 s: %+v", pid, task)
		}
		time.Sleep(5 * time.Millisecond) // polling a condition with a deadline
	}
}

// fuseMount is a FUSE filesystem whose server never answers (not even its
// INIT), mounted in a private mount namespace of one OS thread so that no
// other process on the machine can stumble into it; a process started from
// that thread sees it, and any access blocks until Close aborts the
// connection.
type fuseMount struct {
	fd   int
	reqs chan fuseReq
}

type fuseReq struct {
	cmd  *exec.Cmd
	errc chan error
}

// fuseWithoutServer mounts a fuseMount and returns it with its mount point.
func fuseWithoutServer(t *testing.T) (*fuseMount, string) {
	t.Helper()
	fd, err := unix.Open("/dev/fuse", unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatalf("open /dev/fuse: %v", err)
	}
	mnt := t.TempDir()
	fm := &fuseMount{fd: fd, reqs: make(chan fuseReq)}
	ready := make(chan error, 1)
	// The thread, with its namespace, ends with the function; never the
	// main thread, whose mount namespace /proc/self/mountinfo shows.
	osthread.Throwaway(func() {
		err := unix.Unshare(unix.CLONE_NEWNS)
		if err == nil {
			err = unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, "")
		}
		if err == nil {
			err = unix.Mount("opendsec-test", mnt, "fuse", unix.MS_NOSUID|unix.MS_NODEV,
				fmt.Sprintf("fd=%d,rootmode=40000,user_id=0,group_id=0", fd))
		}
		ready <- err
		if err != nil {
			return
		}
		for r := range fm.reqs {
			r.errc <- r.cmd.Start()
		}
	})
	if err := <-ready; err != nil {
		unix.Close(fd)
		close(fm.reqs)
		t.Fatalf("mount fuse in a private namespace: %v", err)
	}
	t.Cleanup(func() {
		close(fm.reqs)
		fm.Close()
	})
	return fm, mnt
}

func (fm *fuseMount) start(cmd *exec.Cmd) error {
	r := fuseReq{cmd: cmd, errc: make(chan error)}
	fm.reqs <- r
	return <-r.errc
}

// Close aborts the FUSE connection: blocked requests fail with ENOTCONN.
func (fm *fuseMount) Close() error {
	if fm.fd < 0 {
		return nil
	}
	err := unix.Close(fm.fd)
	fm.fd = -1
	return err
}
