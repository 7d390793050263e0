//go:build linux

package e2e

import (
	"fmt"
	"maps"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/api/gen/opendsec/v1/opendsecv1connect"
	"github.com/kernflux/opendsec/internal/auth"
	"github.com/kernflux/opendsec/test/harness"
)

// fork forks id count times through the public API.
func (s *system) fork(t *testing.T, id string, count int32) (*opendsecv1.ForkSandboxResponse, error) {
	t.Helper()
	r, err := s.Sandboxes().ForkSandbox(t.Context(), connect.NewRequest(&opendsecv1.ForkSandboxRequest{SandboxId: id, Count: count}))
	if err != nil {
		return nil, err
	}
	return r.Msg, nil
}

// nodeState is what a refused fork must leave as it was: the sandboxes,
// the mounts under the data dir and the network namespaces.
type nodeState struct {
	sandboxes []string
	mounts    []string
	netns     []string
}

func (s *system) nodeState(t *testing.T) nodeState {
	t.Helper()
	s.waitTeardowns(t)
	var st nodeState
	l, err := s.Sandboxes().ListSandboxes(t.Context(), connect.NewRequest(&opendsecv1.ListSandboxesRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	for _, sb := range l.Msg.GetSandboxes() {
		st.sandboxes = append(st.sandboxes, sb.GetId()+" "+sb.GetState().String())
	}
	slices.Sort(st.sandboxes)
	if n := s.sandboxCount(t); n != len(st.sandboxes) {
		t.Fatalf("sandbox count %d, list %d", n, len(st.sandboxes))
	}
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) > 4 && strings.HasPrefix(f[4], s.DataDir()) {
			st.mounts = append(st.mounts, f[4])
		}
	}
	slices.Sort(st.mounts)
	ents, _ := os.ReadDir(filepath.Join(s.DataDir(), "netns"))
	for _, e := range ents {
		st.netns = append(st.netns, e.Name())
	}
	return st
}

func (a nodeState) equal(b nodeState) bool {
	return slices.Equal(a.sandboxes, b.sandboxes) && slices.Equal(a.mounts, b.mounts) && slices.Equal(a.netns, b.netns)
}

// TestFork: 8 forks of a sandbox that wrote files each see the files, run
// with their own ID and hostname, and carry the source's spec and its
// network policy as SetNetwork left it; a write in one fork is invisible to
// the others and to the source; stopping them all leaves nothing.
func TestFork(t *testing.T) {
	s := newSystem(t)
	inet := harness.MakeInternet(t, s.NodeNS())
	addr := harness.InetIP + ":8080"
	l := harness.ListenIn(t, inet, addr)
	go http.Serve(l, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { fmt.Fprint(w, "hello "+addr) }))
	s.Start()
	empty := s.nodeState(t)

	src := s.create(t, &opendsecv1.SandboxSpec{Labels: map[string]string{"run": "r1"}, TaskId: "tree-7", Env: map[string]string{"STEP": "1"}})
	if r := s.shell(t, src.GetId(), "mkdir -p ~/d && echo step-1 > ~/state.txt && echo deep > ~/d/f && sync"); r.exit.GetExitCode() != 0 {
		t.Fatalf("write files: %+v", r)
	}
	// The policy at the fork is the one SetNetwork set, not the create's.
	s.blocked(t, src.GetId(), addr)
	if _, err := s.Sandboxes().SetNetwork(t.Context(), connect.NewRequest(&opendsecv1.SetNetworkRequest{Id: src.GetId(), Network: &opendsecv1.NetworkPolicy{
		Allow: []*opendsecv1.NetworkRule{{Cidr: harness.InetIP, Protocol: "tcp", Ports: "8080"}},
	}})); err != nil {
		t.Fatal(err)
	}
	srcHost := strings.TrimSpace(s.shell(t, src.GetId(), "hostname").stdout)

	t0 := time.Now()
	out, err := s.fork(t, src.GetId(), 8)
	if err != nil {
		t.Fatalf("fork 8: %v", err)
	}
	t.Logf("fork of 8 took %v, source frozen %d µs", time.Since(t0), out.GetSourceFrozenUs())
	if len(out.GetForks()) != 8 {
		t.Fatalf("%d forks, want 8", len(out.GetForks()))
	}
	hosts := map[string]bool{srcHost: true}
	var ids []string
	for _, f := range out.GetForks() {
		sb := f.GetSandbox()
		id := sb.GetId()
		ids = append(ids, id)
		if f.GetMemoryPreserved() {
			t.Errorf("fork %s: memory_preserved true on the container backend", id)
		}
		if sb.GetParentId() != src.GetId() || sb.GetNodeId() != src.GetNodeId() || sb.GetState() != opendsecv1.SandboxState_SANDBOX_STATE_RUNNING {
			t.Errorf("fork %s: parent %q node %q state %s", id, sb.GetParentId(), sb.GetNodeId(), sb.GetState())
		}
		sp, ssp := sb.GetSpec(), src.GetSpec()
		if sp.GetImage() != ssp.GetImage() || sp.GetCpu() != ssp.GetCpu() || sp.GetMemoryMb() != ssp.GetMemoryMb() || sp.GetTaskId() != "tree-7" ||
			!maps.Equal(sp.GetLabels(), ssp.GetLabels()) || !maps.Equal(sp.GetEnv(), ssp.GetEnv()) {
			t.Errorf("fork %s spec %v, want the source's %v", id, sp, ssp)
		}
		if got := sp.GetNetwork().GetAllow(); len(got) != 1 || got[0].GetPorts() != "8080" {
			t.Errorf("fork %s network %v, want the source's after SetNetwork", id, sp.GetNetwork())
		}
		if r := s.shell(t, id, "cat ~/state.txt ~/d/f; echo $STEP"); r.stdout != "step-1\ndeep\n1\n" {
			t.Errorf("fork %s reads %q %q, want the source's files and env", id, r.stdout, r.stderr)
		}
		h := strings.TrimSpace(s.shell(t, id, "hostname").stdout)
		if hosts[h] {
			t.Errorf("fork %s hostname %q repeats", id, h)
		}
		hosts[h] = true
		s.reaches(t, id, addr)
	}
	if r := s.shell(t, ids[0], "echo fork-0 > ~/state.txt && echo new > ~/only-0 && rm ~/d/f && sync"); r.exit.GetExitCode() != 0 {
		t.Fatalf("write in fork 0: %+v", r)
	}
	for _, id := range append([]string{src.GetId()}, ids[1:]...) {
		if r := s.shell(t, id, "cat ~/state.txt ~/d/f; ls ~/only-0 2>&1 >/dev/null | wc -l"); r.stdout != "step-1\ndeep\n1\n" {
			t.Errorf("%s after fork 0 wrote: %q, want its own files unchanged", id, r.stdout)
		}
	}
	// The source runs on, with its files and hostname.
	if h := strings.TrimSpace(s.shell(t, src.GetId(), "hostname").stdout); h != srcHost {
		t.Errorf("source hostname %q → %q", srcHost, h)
	}
	// A paused source forks too, and stays paused (a fork is no call into
	// it, so it does not auto-resume it).
	if _, err := s.Sandboxes().PauseSandbox(t.Context(), connect.NewRequest(&opendsecv1.PauseSandboxRequest{Id: src.GetId()})); err != nil {
		t.Fatal(err)
	}
	pout, err := s.fork(t, src.GetId(), 1)
	if err != nil {
		t.Fatalf("fork of the paused source: %v", err)
	}
	pf := pout.GetForks()[0].GetSandbox().GetId()
	ids = append(ids, pf)
	if r := s.shell(t, pf, "cat ~/state.txt"); r.stdout != "step-1\n" {
		t.Errorf("fork of the paused source reads %q", r.stdout)
	}
	g, err := s.Sandboxes().GetSandbox(t.Context(), connect.NewRequest(&opendsecv1.GetSandboxRequest{Id: src.GetId()}))
	if err != nil || g.Msg.GetSandbox().GetState() != opendsecv1.SandboxState_SANDBOX_STATE_PAUSED {
		t.Errorf("source after a fork while paused: %v %v, want still paused", g.Msg.GetSandbox().GetState(), err)
	}
	for _, id := range append(ids, src.GetId()) {
		if _, err := s.Sandboxes().StopSandbox(t.Context(), connect.NewRequest(&opendsecv1.StopSandboxRequest{Id: id})); err != nil {
			t.Fatalf("stop %s: %v", id, err)
		}
		if left := s.leftoversAfterStop(t, id); len(left) > 0 {
			t.Errorf("stopped %s left %v", id, left)
		}
	}
	if got := s.nodeState(t); !got.equal(empty) {
		t.Errorf("after stopping all: %+v, was %+v", got, empty)
	}
}

// TestForkBadInput: fork counts 0 and 65, a stopped source, another
// principal's sandbox and a target node are each refused with a clear error
// naming the field, and the node's sandboxes, mounts and network
// namespaces are as they were.
func TestForkBadInput(t *testing.T) {
	s := newSystem(t)
	s.Start()
	src := s.create(t, nil)
	gone := s.create(t, nil)
	if _, err := s.Sandboxes().StopSandbox(t.Context(), connect.NewRequest(&opendsecv1.StopSandboxRequest{Id: gone.GetId()})); err != nil {
		t.Fatal(err)
	}
	key, err := auth.LoadIssuer(filepath.Join(s.DataDir(), "auth.ed25519"))
	if err != nil {
		t.Fatal(err)
	}
	bobTok, err := key.Issue("bob", auth.ScopeUser, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	bob := opendsecv1connect.NewSandboxServiceClient(s.HTTPClient(), s.Endpoint(), s.Opts(bobTok)...)
	before := s.nodeState(t)
	for _, c := range []struct {
		name    string
		call    func() error
		code    connect.Code
		mention string
	}{
		{"count 0", func() error { _, err := s.fork(t, src.GetId(), 0); return err }, connect.CodeInvalidArgument, "count"},
		{"count 65", func() error { _, err := s.fork(t, src.GetId(), 65); return err }, connect.CodeInvalidArgument, "count"},
		{"stopped source", func() error { _, err := s.fork(t, gone.GetId(), 1); return err }, connect.CodeNotFound, "sandbox_id"},
		{"another principal's", func() error {
			_, err := bob.ForkSandbox(t.Context(), connect.NewRequest(&opendsecv1.ForkSandboxRequest{SandboxId: src.GetId(), Count: 1}))
			return err
		}, connect.CodeNotFound, src.GetId()},
		{"target node", func() error {
			_, err := s.Sandboxes().ForkSandbox(t.Context(), connect.NewRequest(&opendsecv1.ForkSandboxRequest{SandboxId: src.GetId(), Count: 1, TargetNode: "n002"}))
			return err
		}, connect.CodeUnimplemented, "target_node"},
		{"malformed id", func() error { _, err := s.fork(t, "not-an-id", 1); return err }, connect.CodeInvalidArgument, "sandbox_id"},
	} {
		wantErr(t, c.name, c.call(), c.code, c.mention)
		if got := s.nodeState(t); !got.equal(before) {
			t.Errorf("%s changed the node: %+v, was %+v", c.name, got, before)
		}
	}
}
