package node

import (
	"context"
	"maps"
	"testing"

	"connectrpc.com/connect"

	nodev1 "github.com/kernflux/opendsec/api/gen/opendsec/node/v1"
	"github.com/kernflux/opendsec/internal/auth"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/runtime/runtimefake"
	"github.com/kernflux/opendsec/internal/sandboxid"
)

// TestInfoCountsLiveSandboxes: Info counts the sandboxes the caller may
// see by backend (an empty spec backend under the default) and by task,
// leaving out stopped and failed ones — what the watcher counted from
// ListSandboxes — and says it did.
func TestInfoCountsLiveSandboxes(t *testing.T) {
	f := newFakeNode(t, func(c *Config) {
		c.Backends = map[string]runtime.Runtime{
			runtimefake.Name: c.Backends[runtimefake.Name],
			"alt":            runtimefake.New(runtimefake.Config{StateRoot: t.Name() + "-alt-" + sandboxid.New("fake")}),
		}
	})
	s := &service{n: f.Node}
	counts := func(ctx context.Context) (map[string]int64, map[string]int64) {
		t.Helper()
		resp, err := s.Info(ctx, connect.NewRequest(&nodev1.InfoRequest{}))
		if err != nil {
			t.Fatal(err)
		}
		if !resp.Msg.GetSandboxCounts() {
			t.Fatal("Info does not say it counted the sandboxes")
		}
		return resp.Msg.GetSandboxesByBackend(), resp.Msg.GetSandboxesByTask()
	}
	node := as("opendsec-watcher", auth.ScopeNode)
	if b, k := counts(node); len(b) != 0 || len(k) != 0 {
		t.Fatalf("empty node counts %v %v", b, k)
	}
	f.create(t, specRecord{TaskID: "t1", TimeoutSec: 600})
	f.create(t, specRecord{Backend: "alt", TaskID: "t1", TimeoutSec: 600})
	f.create(t, specRecord{Backend: runtimefake.Name, TaskID: "t2", TimeoutSec: 600})
	f.create(t, specRecord{TimeoutSec: 600})
	stopped := f.create(t, specRecord{Backend: "alt", TaskID: "t3", TimeoutSec: 600})
	dead := f.create(t, specRecord{TaskID: "t4", TimeoutSec: 600})
	if _, err := f.Create(t.Context(), CreateRequest{ID: sandboxid.New(f.cfg.ID), Owner: "alice",
		Spec: specRecord{Image: "root/busybox", Backend: "alt", TaskID: "t5", TimeoutSec: 600}}); err != nil {
		t.Fatal(err)
	}
	if err := f.Stop(t.Context(), stopped.ID, "test"); err != nil {
		t.Fatal(err)
	}
	// Hold the dead sandbox's cleanup, so it stays in the table, failed.
	held, release := make(chan struct{}, 1), make(chan struct{})
	hold := func(ctx context.Context, id string) error {
		if id != dead.ID {
			return nil
		}
		select {
		case held <- struct{}{}:
		default:
		}
		select {
		case <-release:
		case <-ctx.Done():
		}
		return nil
	}
	f.rt.Hook(runtimefake.OpStop, hold)
	f.rt.Hook(runtimefake.OpDelete, hold)
	t.Cleanup(func() { close(release) })
	if err := f.rt.Kill(dead.ID, "killed by signal 9"); err != nil {
		t.Fatal(err)
	}
	<-held // the node saw the death and is removing the sandbox
	if _, sb, err := f.Get(t.Context(), dead.ID); err != nil || f.toProto(sb).GetState() != nodev1.SandboxState_SANDBOX_STATE_FAILED {
		t.Fatalf("dead sandbox while its cleanup is held: err %v; want it listed failed", err)
	}
	b, k := counts(node)
	if want := map[string]int64{runtimefake.Name: 3, "alt": 2}; !maps.Equal(b, want) {
		t.Errorf("by backend %v; want %v", b, want)
	}
	if want := map[string]int64{"t1": 2, "t2": 1, "t5": 1}; !maps.Equal(k, want) {
		t.Errorf("by task %v; want %v", k, want)
	}
	// A user counts only its own.
	b, k = counts(as("alice", auth.ScopeUser))
	if want := map[string]int64{"alt": 1}; !maps.Equal(b, want) {
		t.Errorf("alice's by backend %v; want %v", b, want)
	}
	if want := map[string]int64{"t5": 1}; !maps.Equal(k, want) {
		t.Errorf("alice's by task %v; want %v", k, want)
	}
}
