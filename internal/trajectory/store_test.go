package trajectory

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kernflux/opendsec/internal/errdefs"
)

func openStore(t *testing.T, dir string, mutate ...func(*Options)) *Store {
	t.Helper()
	o := Options{Dir: dir}
	for _, m := range mutate {
		m(&o)
	}
	s, err := Open(o)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func execReq(cmd ...string) Request { return Request{Kind: KindExec, Command: cmd} }

func run(t *testing.T, l *Log, callID string, req Request, out string, code int32) *Call {
	t.Helper()
	c, prior, err := l.Begin(callID, req, 0)
	if err != nil {
		t.Fatal(err)
	}
	if prior != nil {
		t.Fatalf("call %q already in the log as %d", callID, prior.Seq)
	}
	if err := l.SetPid(c.Seq, 100+uint32(c.Seq)); err != nil {
		t.Fatal(err)
	}
	l.AddOutput(c.Seq, Stdout, []byte(out))
	done, err := l.Finish(c.Seq, Result{Exited: true, ExitCode: code, Status: "exit status"})
	if err != nil {
		t.Fatal(err)
	}
	return done
}

// TestLogSurvivesReopen: calls written and a store opened again over the
// same directory without any close (a node killed) finds every call in
// order, with its output, exit and pid; a call begun and never finished
// is still running.
func TestLogSurvivesReopen(t *testing.T) {
	dir := t.TempDir()
	s := openStore(t, dir)
	l, err := s.Log("sb1", Meta{})
	if err != nil {
		t.Fatal(err)
	}
	for i := range 5 {
		run(t, l, "step-"+string(rune('a'+i)), execReq("echo", string(rune('a'+i))), "out"+string(rune('a'+i)), int32(i))
	}
	open, _, err := l.Begin("step-f", execReq("sleep", "9"), 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := l.SetPid(open.Seq, 4242); err != nil {
		t.Fatal(err)
	}

	s2 := openStore(t, dir)
	l2, err := s2.Log("sb1", Meta{})
	if err != nil {
		t.Fatal(err)
	}
	calls := l2.Calls()
	if len(calls) != 6 {
		t.Fatalf("%d calls after reopen; want 6", len(calls))
	}
	for i, c := range calls[:5] {
		if c.Seq != uint64(i+1) || c.State != StateDone || c.ExitCode != int32(i) || string(c.Output[0].Data) != "out"+string(rune('a'+i)) {
			t.Fatalf("call %d after reopen: %+v", i, c)
		}
	}
	if c := calls[5]; c.State != StateRunning || c.Pid != 4242 || c.CallID != "step-f" {
		t.Fatalf("open call after reopen: %+v; want running with pid 4242", c)
	}
	// The next call continues the sequence.
	if c := run(t, l2, "", execReq("true"), "", 0); c.Seq != 7 {
		t.Fatalf("seq after reopen %d; want 7", c.Seq)
	}
}

// TestBeginFindsPriorAndRefusesMismatch: the same call ID with the same
// request returns the recorded call; with another request it is a failed
// precondition naming both requests.
func TestBeginFindsPriorAndRefusesMismatch(t *testing.T) {
	s := openStore(t, t.TempDir())
	l, _ := s.Log("sb1", Meta{})
	first := run(t, l, "r1/0", execReq("sh", "-c", "echo hi >> f"), "hi\n", 0)
	c, prior, err := l.Begin("r1/0", execReq("sh", "-c", "echo hi >> f"), 0)
	if err != nil || c != nil || prior == nil || prior.Seq != first.Seq || string(prior.Output[0].Data) != "hi\n" {
		t.Fatalf("repeat: c=%v prior=%+v err=%v; want the recorded call", c, prior, err)
	}
	_, _, err = l.Begin("r1/0", execReq("sh", "-c", "rm -rf /"), 0)
	var me *MismatchError
	if !errors.As(err, &me) || !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Fatalf("mismatch: %v; want a failed precondition", err)
	}
	for _, want := range []string{`"echo hi >> f"`, `"rm -rf /"`, `"r1/0"`} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("mismatch error %q does not name %s", err, want)
		}
	}
	if n := len(l.Calls()); n != 1 {
		t.Fatalf("%d calls after the refused one; want 1", n)
	}
}

// TestCallIDLimit: a 10 KB call ID, one with a control character and one
// not UTF-8 are refused naming the field.
func TestCallIDLimit(t *testing.T) {
	s := openStore(t, t.TempDir())
	l, _ := s.Log("sb1", Meta{})
	for _, id := range []string{strings.Repeat("x", 10<<10), "a\nb", "\xff"} {
		_, _, err := l.Begin(id, execReq("true"), 0)
		if !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), "call_id") {
			t.Errorf("call ID %.20q: %v; want invalid argument naming call_id", id, err)
		}
	}
	if _, _, err := l.Begin(strings.Repeat("x", MaxCallIDBytes), execReq("true"), 0); err != nil {
		t.Errorf("a call ID of exactly %d bytes: %v", MaxCallIDBytes, err)
	}
}

// TestTornTailCut: a partly written last frame (a crash mid-write) and
// garbage after it are cut; the calls before it stay.
func TestTornTailCut(t *testing.T) {
	dir := t.TempDir()
	s := openStore(t, dir)
	l, _ := s.Log("sb1", Meta{})
	run(t, l, "a", execReq("echo", "a"), "a", 0)
	run(t, l, "b", execReq("echo", "b"), "b", 0)
	p := s.path("sb1")
	fi, _ := os.Stat(p)
	// Cut the last frame in half.
	if err := os.Truncate(p, fi.Size()-10); err != nil {
		t.Fatal(err)
	}
	s2 := openStore(t, dir)
	l2, err := s2.Log("sb1", Meta{})
	if err != nil {
		t.Fatal(err)
	}
	calls := l2.Calls()
	if len(calls) != 2 || calls[1].State != StateRunning || calls[0].State != StateDone {
		t.Fatalf("after a torn end entry: %+v; want a done and the running begin of b", calls)
	}
	// Appends after the cut are read back.
	if _, err := l2.Finish(2, Result{Exited: true}); err != nil {
		t.Fatal(err)
	}
	_, calls, err = openStore(t, dir).Read("sb1")
	if err != nil || len(calls) != 2 || calls[1].State != StateDone {
		t.Fatalf("after finishing past the cut: %+v %v", calls, err)
	}
}

// TestOutputCap: output past the cap is not recorded and marks the call
// truncated with the full byte count.
func TestOutputCap(t *testing.T) {
	s := openStore(t, t.TempDir(), func(o *Options) { o.MaxOutputBytes = 10 })
	l, _ := s.Log("sb1", Meta{})
	c, _, _ := l.Begin("", execReq("yes"), 0)
	l.AddOutput(c.Seq, Stdout, []byte("0123456"))
	l.AddOutput(c.Seq, Stdout, []byte("789abc"))
	l.AddOutput(c.Seq, Stderr, []byte("e"))
	done, _ := l.Finish(c.Seq, Result{Exited: true})
	if !done.Truncated || done.StdoutBytes != 13 || string(done.Output[0].Data) != "0123456789" || string(done.Output[1].Data) != "e" {
		t.Fatalf("capped call: %+v", done)
	}
	// A call's own cap under the store's.
	c, _, _ = l.Begin("", execReq("yes"), 3)
	l.AddOutput(c.Seq, Stdout, []byte("0123456"))
	done, _ = l.Finish(c.Seq, Result{Exited: true})
	if !done.Truncated || string(done.Output[0].Data) != "012" {
		t.Fatalf("call with cap 3: %+v", done)
	}
}

// TestCompactionDropsOldestOutputOnly: a log past its bound loses the
// output of its oldest calls, marked compacted, never a call record; the
// newest call's output stays, and the compacted log reloads the same.
func TestCompactionDropsOldestOutputOnly(t *testing.T) {
	dir := t.TempDir()
	s := openStore(t, dir, func(o *Options) { o.MaxBytes = 64 << 10 })
	l, _ := s.Log("sb1", Meta{})
	big := strings.Repeat("x", 8<<10)
	for i := range 40 {
		run(t, l, "s"+strings.Repeat("i", i%3)+string(rune('A'+i)), execReq("echo", string(rune('A'+i))), big, 0)
	}
	if l.Size() > 64<<10 {
		t.Fatalf("log is %d bytes; bound 64 KiB", l.Size())
	}
	calls := l.Calls()
	if len(calls) != 40 {
		t.Fatalf("%d call records after compaction; want all 40", len(calls))
	}
	if !calls[0].Compacted || calls[0].Output != nil {
		t.Errorf("oldest call not compacted: %+v", calls[0].Compacted)
	}
	if last := calls[39]; last.Compacted || string(last.Output[0].Data) != big {
		t.Errorf("newest call lost its output")
	}
	_, re, err := openStore(t, dir).Read("sb1")
	if err != nil || len(re) != 40 || re[0].CallID != calls[0].CallID || !re[0].Compacted || string(re[39].Output[0].Data) != big {
		t.Fatalf("compacted log read back: %d calls, %v", len(re), err)
	}
}

// TestForkCarriesParentLog: a fork's log starts with its parent's calls
// (running ones interrupted), names the parent, and goes on numbering.
func TestForkCarriesParentLog(t *testing.T) {
	s := openStore(t, t.TempDir())
	l, _ := s.Log("parent", Meta{})
	run(t, l, "a", execReq("echo", "a"), "a", 0)
	if _, _, err := l.Begin("b", execReq("sleep", "9"), 0); err != nil {
		t.Fatal(err)
	}
	if err := s.Fork("parent", "child", Meta{}); err != nil {
		t.Fatal(err)
	}
	cl, _ := s.Log("child", Meta{})
	m := cl.Meta()
	if m.ParentID != "parent" || m.ForkSeq != 2 {
		t.Fatalf("fork meta %+v", m)
	}
	calls := cl.Calls()
	if len(calls) != 2 || calls[0].Origin != "parent" || calls[0].State != StateDone || calls[1].State != StateInterrupted {
		t.Fatalf("fork calls %+v", calls)
	}
	if p := cl.Find("a"); p == nil || string(p.Output[0].Data) != "a" {
		t.Fatalf("the fork does not answer the parent's call ID")
	}
	if c := run(t, cl, "c", execReq("true"), "", 0); c.Seq != 3 {
		t.Fatalf("fork's first own call is %d; want 3", c.Seq)
	}
	if len(l.Calls()) != 2 {
		t.Fatal("the fork's call went into the parent's log")
	}
}

// TestExportRestore: a snapshot's copy of a log (Export) starts the logs
// of sandboxes restored from it in another store (another node): the
// source's calls up to the copy, running ones interrupted, the source as
// parent; calls after the copy are not in it.
func TestExportRestore(t *testing.T) {
	src := openStore(t, t.TempDir())
	l, _ := src.Log("source", Meta{})
	run(t, l, "a", execReq("echo", "a"), "a", 0)
	if _, _, err := l.Begin("b", execReq("sleep", "9"), 0); err != nil {
		t.Fatal(err)
	}
	copyPath := filepath.Join(t.TempDir(), "snap.log")
	if err := src.Export("source", copyPath); err != nil {
		t.Fatal(err)
	}
	run(t, l, "late", execReq("echo", "late"), "late", 0)

	other := openStore(t, t.TempDir())
	if err := other.Restore(copyPath, "restored", Meta{Owner: "alice"}); err != nil {
		t.Fatal(err)
	}
	rl, _ := other.Log("restored", Meta{})
	m := rl.Meta()
	if m.ParentID != "source" || m.ForkSeq != 2 || m.Owner != "alice" || m.SandboxID != "restored" {
		t.Fatalf("restored meta %+v", m)
	}
	calls := rl.Calls()
	if len(calls) != 2 || calls[0].Origin != "source" || calls[0].State != StateDone ||
		calls[1].State != StateInterrupted || !strings.Contains(calls[1].ErrMsg, "snapshotted") {
		t.Fatalf("restored calls %+v", calls)
	}
	if rl.Find("late") != nil {
		t.Fatal("a call after the snapshot is in the restored log")
	}
	if c := run(t, rl, "c", execReq("true"), "", 0); c.Seq != 3 {
		t.Fatalf("restored log's first own call is %d; want 3", c.Seq)
	}
	// A repeated restore keeps the log.
	if err := other.Restore(copyPath, "restored", Meta{}); err != nil || len(rl.Calls()) != 3 {
		t.Fatalf("repeated restore: %v, %d calls", err, len(rl.Calls()))
	}
	// A sandbox that never logged a call exports an empty log naming it.
	empty := filepath.Join(t.TempDir(), "empty.log")
	if err := src.Export("quiet", empty); err != nil {
		t.Fatal(err)
	}
	if m, calls, err := ReadFile(empty); err != nil || m.SandboxID != "quiet" || len(calls) != 0 {
		t.Fatalf("empty export: %+v %d %v", m, len(calls), err)
	}
}

// TestRetention: a stopped sandbox's log is readable until its retention
// passes, then Sweep removes it; a live one stays.
func TestRetention(t *testing.T) {
	now := time.Now()
	clock := func() time.Time { return now }
	dir := t.TempDir()
	s := openStore(t, dir, func(o *Options) { o.Retention = time.Hour; o.Clock = clock })
	l, _ := s.Log("gone", Meta{})
	run(t, l, "a", execReq("true"), "", 0)
	live, _ := s.Log("live", Meta{})
	run(t, live, "a", execReq("true"), "", 0)
	if err := s.Close("gone"); err != nil {
		t.Fatal(err)
	}
	if m, calls, err := s.Read("gone"); err != nil || len(calls) != 1 || m.Closed.IsZero() {
		t.Fatalf("stopped log: %+v %d %v", m, len(calls), err)
	}
	if n, _ := s.Sweep(func(string) bool { return false }); n != 0 {
		t.Fatalf("swept %d before the retention passed", n)
	}
	now = now.Add(2 * time.Hour)
	if n, err := s.Sweep(func(id string) bool { return id == "live" }); n != 1 || err != nil {
		t.Fatalf("swept %d (%v); want 1", n, err)
	}
	if _, _, err := s.Read("gone"); !errdefs.IsNotFound(err) {
		t.Fatalf("read after sweep: %v; want not found", err)
	}
	if _, calls, err := s.Read("live"); err != nil || len(calls) != 1 {
		t.Fatalf("live log after sweep: %v", err)
	}
}

// TestCloseAfterReopenStampsStop: a log the node did not open since its
// restart is still stamped closed at its sandbox's stop, and its file
// touched, so that its retention counts from the stop.
func TestCloseAfterReopenStampsStop(t *testing.T) {
	dir := t.TempDir()
	s1 := openStore(t, dir)
	l, _ := s1.Log("sb1", Meta{Owner: "alice"})
	run(t, l, "a", execReq("true"), "", 0)
	old := time.Now().Add(-48 * time.Hour)
	if err := os.Chtimes(filepath.Join(dir, "sb1.log"), old, old); err != nil {
		t.Fatal(err)
	}
	s2 := openStore(t, dir) // the node restarted
	if err := s2.Close("sb1"); err != nil {
		t.Fatal(err)
	}
	m, calls, err := s2.Read("sb1")
	if err != nil || len(calls) != 1 || m.Closed.IsZero() || m.Owner != "alice" {
		t.Fatalf("after close: meta %+v, %d calls, %v; want closed, alice's, 1 call", m, len(calls), err)
	}
	if n, _ := s2.Sweep(func(string) bool { return false }); n != 0 {
		t.Fatalf("swept %d logs: the retention must count from the stop", n)
	}
	if err := s2.Close("never"); err != nil {
		t.Fatalf("close of a sandbox without a log: %v", err)
	}
}

// TestWatchSeesOutputAndEnd: a watcher of a running call is woken by its
// output and by its end.
func TestWatchSeesOutputAndEnd(t *testing.T) {
	s := openStore(t, t.TempDir())
	l, _ := s.Log("sb1", Meta{})
	c, _, _ := l.Begin("x", execReq("cat"), 0)
	_, ch := l.Watch(c.Seq)
	l.AddOutput(c.Seq, Stdout, []byte("a"))
	<-ch
	cur, ch := l.Watch(c.Seq)
	if string(cur.Output[0].Data) != "a" {
		t.Fatalf("watch after output: %+v", cur)
	}
	if _, err := l.Finish(c.Seq, Result{Exited: true, ExitCode: 3}); err != nil {
		t.Fatal(err)
	}
	<-ch
	if cur, _ := l.Watch(c.Seq); cur.State != StateDone || cur.ExitCode != 3 {
		t.Fatalf("watch after end: %+v", cur)
	}
}

// TestCodeRequest: code calls with other code, language, context or env
// vars are different requests, and their errors name the code.
func TestCodeRequest(t *testing.T) {
	a := Request{Kind: KindCode, Code: "print(1)", Language: "python", Env: map[string]string{"A": "1"}}
	if !a.Same(a) {
		t.Fatal("a request is not the same as itself")
	}
	for _, b := range []Request{
		{Kind: KindCode, Code: "print(2)", Language: "python", Env: map[string]string{"A": "1"}},
		{Kind: KindCode, Code: "print(1)", Env: map[string]string{"A": "1"}},
		{Kind: KindCode, Code: "print(1)", Language: "python", ContextID: "c", Env: map[string]string{"A": "1"}},
		{Kind: KindCode, Code: "print(1)", Language: "python"},
		{Kind: KindExec, Command: []string{"print(1)"}, Env: map[string]string{"A": "1"}},
	} {
		if a.Same(b) {
			t.Fatalf("%s is the same as %s", a, b)
		}
	}
	if s := a.String(); s != `code "print(1)" (python) with 1 env vars` {
		t.Fatalf("String: %s", s)
	}
}
