//go:build linux

package e2e

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
)

// pooledIDs returns the node's sandbox dirs that no listed sandbox owns:
// the warm pool's prestarted sandboxes.
func (s *system) pooledIDs(t *testing.T) []string {
	t.Helper()
	l, err := s.Sandboxes().ListSandboxes(t.Context(), connect.NewRequest(&opendsecv1.ListSandboxesRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	listed := map[string]bool{}
	for _, sb := range l.Msg.Sandboxes {
		listed[sb.GetId()] = true
	}
	ents, _ := os.ReadDir(filepath.Join(s.DataDir(), "node", "sandboxes"))
	var out []string
	for _, e := range ents {
		if !listed[e.Name()] {
			out = append(out, e.Name())
		}
	}
	return out
}

func (s *system) waitPooled(t *testing.T, n int) []string {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		ids := s.pooledIDs(t)
		if len(ids) >= n {
			return ids
		}
		if time.Now().After(deadline) {
			t.Fatalf("warm pool holds %d prestarted sandboxes after 60s, want %d", len(ids), n)
		}
		time.Sleep(20 * time.Millisecond) // polling a condition with a deadline
	}
}

// TestWarmPool, through the public API of a real system: the first two
// creates of a shape are cold, the pool then prestarts sandboxes of it
// (never listed), the next create takes one (from_warm_pool, the caller's
// env, nothing of anyone else's), skip_warm_pool makes a cold one, a
// pooled sandbox stops without leftovers, and prestarted sandboxes left by
// a kill -9 of the node are removed at its next start.
func TestWarmPool(t *testing.T) {
	s := newSystemPool(t, 2)
	s.Start()
	first := s.create(t, &opendsecv1.SandboxSpec{Env: map[string]string{"WHO": "first"}})
	second := s.create(t, &opendsecv1.SandboxSpec{Env: map[string]string{"WHO": "second"}})
	if first.GetFromWarmPool() || second.GetFromWarmPool() {
		t.Fatal("one of the first two creates of a shape came from the warm pool")
	}
	s.waitPooled(t, 2)

	warm := s.create(t, &opendsecv1.SandboxSpec{Env: map[string]string{"WHO": "warm"}, Labels: map[string]string{"pool": "yes"}})
	if !warm.GetFromWarmPool() {
		t.Fatal("create of a known shape with a full pool did not take a prestarted sandbox")
	}
	if r := s.shell(t, warm.GetId(), `echo "$WHO $(hostname) $(cat /proc/1/cmdline | tr '\0' ' ' | cut -c1-15)"`); r.stdout != "warm "+warm.GetId()+" /.opendsec/init\n" {
		t.Fatalf("pooled sandbox answered %q", r.stdout)
	}
	l, err := s.Sandboxes().ListSandboxes(t.Context(), connect.NewRequest(&opendsecv1.ListSandboxesRequest{Labels: map[string]string{"pool": "yes"}}))
	if err != nil || len(l.Msg.Sandboxes) != 1 || l.Msg.Sandboxes[0].GetId() != warm.GetId() || !l.Msg.Sandboxes[0].GetFromWarmPool() {
		t.Fatalf("list by label: %v, %v", l, err)
	}
	cold, err := s.Sandboxes().CreateSandbox(t.Context(), connect.NewRequest(&opendsecv1.CreateSandboxRequest{
		Spec: &opendsecv1.SandboxSpec{Image: "root/busybox"}, SkipWarmPool: true}))
	if err != nil {
		t.Fatal(err)
	}
	if cold.Msg.GetSandbox().GetFromWarmPool() {
		t.Fatal("skip_warm_pool create came from the pool")
	}
	for _, id := range []string{warm.GetId(), cold.Msg.GetSandbox().GetId()} {
		if _, err := s.Sandboxes().StopSandbox(t.Context(), connect.NewRequest(&opendsecv1.StopSandboxRequest{Id: id})); err != nil {
			t.Fatalf("stop %s: %v", id, err)
		}
		if left := s.leftoversAfterStop(t, id); len(left) > 0 {
			t.Errorf("sandbox %s left behind:\n%s", id, strings.Join(left, "\n"))
		}
	}

	// A kill -9 leaves prestarted sandboxes; the next start removes them
	// and keeps the running one.
	pooled := s.waitPooled(t, 2)
	s.Kill9()
	s.Start()
	for _, id := range pooled {
		if left := s.leftovers(id); len(left) > 0 {
			t.Errorf("prestarted sandbox %s left after kill -9 and restart:\n%s", id, strings.Join(left, "\n"))
		}
	}
	if got := s.pooledIDs(t); len(got) != 0 && slices.ContainsFunc(got, func(id string) bool { return slices.Contains(pooled, id) }) {
		t.Errorf("sandbox dirs of prestarted sandboxes left after restart: %v", got)
	}
	if r := s.shell(t, first.GetId(), "echo $WHO"); r.stdout != "first\n" {
		t.Fatalf("running sandbox after restart answered %q", r.stdout)
	}
}
