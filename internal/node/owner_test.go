package node

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	"connectrpc.com/connect"

	nodev1 "github.com/kernflux/opendsec/api/gen/opendsec/node/v1"
	"github.com/kernflux/opendsec/internal/auth"
	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/sandboxid"
)

func as(sub, scope string) context.Context {
	return auth.WithClaims(context.Background(), auth.Claims{Subject: sub, Scope: scope})
}

// The node's service answers a user only for the sandboxes it owns; an
// admin and a component on its own behalf see all; a record from before
// owners (none recorded) is visible to admins only.
func TestServiceHoldsUsersToTheirSandboxes(t *testing.T) {
	now := time.Now().UTC()
	rec := func(owner string) *record {
		return &record{ID: sandboxid.New("t001"), Backend: "fake", State: stateRunning, Owner: owner,
			Spec:      specRecord{Backend: "fake", TimeoutSec: 3600},
			CreatedAt: now, ExpiresAt: now.Add(time.Hour), StateDir: filepath.Join(t.TempDir(), "sb")}
	}
	alice, legacy := rec("alice"), rec("")
	n := openRecorded(t, &blockingRuntime{stopping: map[string]int{}, stops: map[string]int{}}, alice, legacy)
	s := &service{n: n}
	get := func(ctx context.Context, id string) error {
		_, err := s.GetSandbox(ctx, connect.NewRequest(&nodev1.GetSandboxRequest{SandboxId: id}))
		return err
	}
	list := func(ctx context.Context) int {
		resp, err := s.ListSandboxes(ctx, connect.NewRequest(&nodev1.ListSandboxesRequest{}))
		if err != nil {
			t.Fatal(err)
		}
		return len(resp.Msg.GetSandboxes())
	}
	for _, c := range []struct {
		ctx           context.Context
		name          string
		alice, legacy bool
		n             int
	}{
		{as("alice", auth.ScopeUser), "alice", true, false, 1},
		{as("bob", auth.ScopeUser), "bob", false, false, 0},
		{as("root", auth.ScopeAdmin), "admin", true, true, 2},
		{as("opendsec-watcher", auth.ScopeNode), "component", true, true, 2},
	} {
		if err := get(c.ctx, alice.ID); (err == nil) != c.alice || (err != nil && !errdefs.IsNotFound(err)) {
			t.Errorf("%s gets alice's: %v, want visible %v (else not_found)", c.name, err, c.alice)
		}
		if err := get(c.ctx, legacy.ID); (err == nil) != c.legacy {
			t.Errorf("%s gets the ownerless one: %v, want visible %v", c.name, err, c.legacy)
		}
		if got := list(c.ctx); got != c.n {
			t.Errorf("%s lists %d, want %d", c.name, got, c.n)
		}
	}
	if _, err := s.StopSandbox(as("bob", auth.ScopeUser), connect.NewRequest(&nodev1.StopSandboxRequest{SandboxId: alice.ID})); !errdefs.IsNotFound(err) {
		t.Fatalf("bob stops alice's: %v, want not_found", err)
	}
	if err := get(as("alice", auth.ScopeUser), alice.ID); err != nil {
		t.Fatalf("alice's sandbox after bob's stop: %v", err)
	}
}

// A create records the caller's principal and project, and a component on
// its own behalf records none.
func TestOwnerOf(t *testing.T) {
	ctx := auth.WithClaims(context.Background(), auth.Claims{Subject: "alice", Scope: auth.ScopeUser, Project: "p"})
	if o, p := ownerOf(ctx); o != "alice" || p != "p" {
		t.Fatalf("user: %q %q", o, p)
	}
	if o, _ := ownerOf(as("root", auth.ScopeAdmin)); o != "root" {
		t.Fatalf("admin: %q", o)
	}
	if o, _ := ownerOf(as("opendsec-apiserver", auth.ScopeNode)); o != "" {
		t.Fatalf("component: %q", o)
	}
	// Projects separate principals of the same name.
	other := caller{principal: "alice", project: "q"}
	if other.owns(&record{Owner: "alice", Project: "p"}) {
		t.Fatal("alice of project q owns alice of project p's sandbox")
	}
}
