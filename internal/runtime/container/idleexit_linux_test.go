package container

import (
	"bytes"
	"context"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/api/gen/process"
	"github.com/kernflux/opendsec/api/gen/process/processconnect"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/runtime/runtimetest"
)

// hostProc is one process seen in the host's /proc.
type hostProc struct {
	pid, ppid int
	comm      string
	state     byte
}

func readProc(pid int) (hostProc, bool) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return hostProc{}, false
	}
	i, j := bytes.IndexByte(b, '('), bytes.LastIndexByte(b, ')')
	f := bytes.Fields(b[j+1:])
	if i < 0 || len(f) < 2 {
		return hostProc{}, false
	}
	ppid, _ := strconv.Atoi(string(f[1]))
	return hostProc{pid: pid, ppid: ppid, comm: string(b[i+1 : j]), state: f[0][0]}, true
}

// tree returns the processes descended from root (root excluded).
func tree(root int) []hostProc {
	ents, _ := os.ReadDir("/proc")
	byParent := map[int][]hostProc{}
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if p, ok := readProc(pid); ok {
			byParent[p.ppid] = append(byParent[p.ppid], p)
		}
	}
	var out []hostProc
	next := []int{root}
	for len(next) > 0 {
		pid := next[0]
		next = next[1:]
		for _, c := range byParent[pid] {
			out = append(out, c)
			next = append(next, c.pid)
		}
	}
	return out
}

// serverPid is the running agent server under init, or 0.
func serverPid(initPid int) int {
	for _, p := range tree(initPid) {
		if p.ppid == initPid && p.comm == "agent" {
			return p.pid
		}
	}
	return 0
}

func pollUntil(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not after %s", what, timeout)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// noneLeft reports whether init's tree has no process named in comms and no
// zombie at all.
func noneLeft(initPid int, comms ...string) bool {
	for _, p := range tree(initPid) {
		if p.state == 'Z' {
			return false
		}
		for _, c := range comms {
			if p.comm == c {
				return false
			}
		}
	}
	return true
}

// TestIdleExit: the agent server exits when idle, opendsec-init (PID 1)
// starts it again on the next connection, a background process keeps it
// alive and can be reconnected to after the idle window, orphans are reaped
// with and without the server, and SIGTERM to init ends the sandbox.
func TestIdleExit(t *testing.T) {
	const idle = time.Second
	f := newFactoryWith(t, func(c *Config) { ms := idle.Milliseconds(); c.AgentIdleExitMS = &ms })
	rt, tmpl := f(t)
	spec, _ := runtimetest.StartSandbox(t, rt, tmpl)
	ctx := t.Context()
	st, err := rt.Status(ctx, spec.ID)
	if err != nil {
		t.Fatal(err)
	}
	initPid := st.Pid
	if p, _ := readProc(initPid); p.comm != "init" {
		t.Fatalf("sandbox init is %q, want opendsec-init", p.comm)
	}
	pollUntil(t, 15*time.Second, "agent server to exit idle", func() bool { return serverPid(initPid) == 0 })
	if p, ok := readProc(initPid); !ok || p.comm != "init" {
		t.Fatalf("init gone after the server's idle exit")
	}

	t.Run("ExecRespawnsServer", func(t *testing.T) {
		start := time.Now()
		res := sh(t, rt, spec.ID, "echo hi")
		t.Logf("first exec after idle exit: %s", time.Since(start))
		if res.Stdout != "hi\n" || res.ExitCode != 0 {
			t.Fatalf("exec: %+v", res)
		}
		if serverPid(initPid) == 0 {
			t.Fatal("exec answered but no server runs under init")
		}
	})

	t.Run("BackgroundProcessKeepsServer", func(t *testing.T) {
		pc := processconnect.NewProcessClient(runtimetest.AgentHTTPClient(rt, spec.ID), "http://agent")
		sctx, cancel := context.WithCancel(ctx)
		noStdin := false
		stream, err := pc.Start(sctx, connect.NewRequest(&process.StartRequest{
			Process: &process.ProcessConfig{Cmd: "/bin/sh", Args: []string{"-c", "echo started; while [ ! -e /tmp/stop ]; do sleep 0.05; done; echo finished"}},
			Stdin:   &noStdin,
		}))
		if err != nil {
			t.Fatal(err)
		}
		var pid uint32
		var out strings.Builder
		for !strings.Contains(out.String(), "started") && stream.Receive() {
			ev := stream.Msg().GetEvent()
			if s := ev.GetStart(); s != nil {
				pid = s.GetPid()
			}
			out.Write(ev.GetData().GetStdout())
		}
		// Disconnect: the process runs on.
		cancel()
		stream.Close()
		if pid == 0 || !strings.Contains(out.String(), "started") {
			t.Fatalf("start: pid %d output %q err %v", pid, out.String(), stream.Err())
		}
		server := serverPid(initPid)
		// Three idle windows: the server must not exit while its child runs.
		window := time.Now().Add(3 * idle)
		for time.Now().Before(window) {
			if got := serverPid(initPid); got != server {
				t.Fatalf("server changed from %d to %d while a process ran", server, got)
			}
			time.Sleep(50 * time.Millisecond)
		}
		list, err := pc.List(ctx, connect.NewRequest(&process.ListRequest{}))
		if err != nil {
			t.Fatal(err)
		}
		found := false
		for _, p := range list.Msg.GetProcesses() {
			found = found || p.GetPid() == pid
		}
		if !found {
			t.Fatalf("process %d not listed after the idle window: %v", pid, list.Msg.GetProcesses())
		}
		cstream, err := pc.Connect(ctx, connect.NewRequest(&process.ConnectRequest{
			Process: &process.ProcessSelector{Selector: &process.ProcessSelector_Pid{Pid: pid}},
		}))
		if err != nil {
			t.Fatal(err)
		}
		defer cstream.Close()
		if res := sh(t, rt, spec.ID, "touch /tmp/stop"); res.ExitCode != 0 {
			t.Fatalf("touch: %+v", res)
		}
		out.Reset()
		var end *process.ProcessEvent_EndEvent
		for end == nil && cstream.Receive() {
			ev := cstream.Msg().GetEvent()
			out.Write(ev.GetData().GetStdout())
			end = ev.GetEnd()
		}
		if end == nil || end.GetExitCode() != 0 || !strings.Contains(out.String(), "finished") {
			t.Fatalf("reconnected stream: end %v output %q err %v", end, out.String(), cstream.Err())
		}
		pollUntil(t, 10*idle, "server to exit idle once the process ended", func() bool { return serverPid(initPid) == 0 })
	})

	t.Run("OrphansReapedByServer", func(t *testing.T) {
		res := sh(t, rt, spec.ID, "(sleep 0.3 </dev/null >/dev/null 2>&1 &); exit 0")
		if res.ExitCode != 0 {
			t.Fatalf("run: %+v", res)
		}
		pollUntil(t, 10*time.Second, "orphaned sleep reaped", func() bool { return noneLeft(initPid, "sleep") })
	})

	t.Run("OrphansReapedWithoutServer", func(t *testing.T) {
		pc := processconnect.NewProcessClient(runtimetest.AgentHTTPClient(rt, spec.ID), "http://agent")
		sctx, cancel := context.WithCancel(ctx)
		defer cancel()
		noStdin := false
		stream, err := pc.Start(sctx, connect.NewRequest(&process.StartRequest{
			Process: &process.ProcessConfig{Cmd: "/bin/sh", Args: []string{"-c", "sleep 0.5; true"}},
			Stdin:   &noStdin,
		}))
		if err != nil {
			t.Fatal(err)
		}
		if !stream.Receive() || stream.Msg().GetEvent().GetStart() == nil {
			t.Fatalf("no start event: %v", stream.Err())
		}
		server := serverPid(initPid)
		if server == 0 {
			t.Fatal("no server while a process runs")
		}
		// The server dies; its processes become init's orphans.
		if err := unix.Kill(server, unix.SIGKILL); err != nil {
			t.Fatal(err)
		}
		cancel()
		stream.Close()
		pollUntil(t, 10*time.Second, "orphans of the killed server reaped by init", func() bool {
			return serverPid(initPid) != server && noneLeft(initPid, "sleep", "sh")
		})
		if res := sh(t, rt, spec.ID, "echo again"); res.Stdout != "again\n" {
			t.Fatalf("exec after the server was killed: %+v", res)
		}
	})

	t.Run("SIGTERMEndsIdleSandbox", func(t *testing.T) {
		pollUntil(t, 15*time.Second, "agent server to exit idle", func() bool { return serverPid(initPid) == 0 })
		if err := unix.Kill(initPid, unix.SIGTERM); err != nil {
			t.Fatal(err)
		}
		pollUntil(t, 5*time.Second, "sandbox to stop on SIGTERM", func() bool {
			st, err := rt.Status(ctx, spec.ID)
			return err == nil && st.State == runtime.StateStopped
		})
	})
}

// TestSIGTERMEndsBusySandbox: SIGTERM to init with the server running a
// process: init forwards it, the server ends its processes and exits, and
// init follows.
func TestSIGTERMEndsBusySandbox(t *testing.T) {
	f := newFactory(t)
	rt, tmpl := f(t)
	spec, _ := runtimetest.StartSandbox(t, rt, tmpl)
	ctx := t.Context()
	st, err := rt.Status(ctx, spec.ID)
	if err != nil {
		t.Fatal(err)
	}
	if res := sh(t, rt, spec.ID, "sleep 1000 </dev/null >/dev/null 2>&1 & echo ok"); res.Stdout != "ok\n" {
		t.Fatalf("start sleep: %+v", res)
	}
	pollUntil(t, 5*time.Second, "sleep running", func() bool { return !noneLeft(st.Pid, "sleep") })
	if err := unix.Kill(st.Pid, unix.SIGTERM); err != nil {
		t.Fatal(err)
	}
	pollUntil(t, 10*time.Second, "sandbox to stop on SIGTERM", func() bool {
		st, err := rt.Status(ctx, spec.ID)
		return err == nil && st.State == runtime.StateStopped
	})
	if p, ok := readProc(st.Pid); ok && p.state != 'Z' {
		t.Errorf("init %d still runs (state %c)", st.Pid, p.state)
	}
}
