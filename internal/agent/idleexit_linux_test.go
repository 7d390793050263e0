package agent

import (
	"context"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	fspb "github.com/kernflux/opendsec/api/gen/filesystem"
	"github.com/kernflux/opendsec/api/gen/process"
)

// TestBusy: requests in flight, child processes and polling watchers each
// keep the agent from exiting idle; nothing else does.
func TestBusy(t *testing.T) {
	e := newEnv(t, Config{})
	eventually(t, 10*time.Second, "an idle agent", func() bool { return e.agent.Busy() == "" })

	ctx, cancel := context.WithCancel(t.Context())
	s, err := e.proc.Start(ctx, startReq("sleep", "30"))
	if err != nil {
		t.Fatal(err)
	}
	if !s.Receive() || s.Msg().GetEvent().GetStart() == nil {
		t.Fatalf("no start event: %v", s.Err())
	}
	p := s.Msg().GetEvent().GetStart().GetPid()
	if why := e.agent.Busy(); !strings.Contains(why, "requests in flight") {
		t.Errorf("Busy with an open stream = %q", why)
	}
	cancel()
	s.Close()
	eventually(t, 5*time.Second, "busy with the child only", func() bool {
		return strings.Contains(e.agent.Busy(), "child processes")
	})
	if _, err := e.proc.SendSignal(t.Context(), connect.NewRequest(&process.SendSignalRequest{Process: pid(p), Signal: process.Signal_SIGNAL_SIGKILL})); err != nil {
		t.Fatal(err)
	}
	eventually(t, 5*time.Second, "idle once the child is gone", func() bool { return e.agent.Busy() == "" })

	cw, err := e.fs.CreateWatcher(t.Context(), connect.NewRequest(&fspb.CreateWatcherRequest{Path: t.TempDir()}))
	if err != nil {
		t.Fatal(err)
	}
	if why := e.agent.Busy(); !strings.Contains(why, "watchers") {
		t.Errorf("Busy with a watcher = %q", why)
	}
	if _, err := e.fs.RemoveWatcher(t.Context(), connect.NewRequest(&fspb.RemoveWatcherRequest{WatcherId: cw.Msg.GetWatcherId()})); err != nil {
		t.Fatal(err)
	}
	if why := e.agent.Busy(); why != "" {
		t.Errorf("Busy after the watcher was removed = %q", why)
	}
	wctx, wcancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer wcancel()
	if err := e.agent.WaitIdle(wctx, 100*time.Millisecond); err != nil {
		t.Fatalf("WaitIdle: %v", err)
	}
}
