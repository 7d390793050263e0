package node

import (
	"context"
	"errors"
	"strings"
	"testing"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	nodev1 "github.com/kernflux/opendsec/api/gen/opendsec/node/v1"
	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/runtime/runtimefake"
	"github.com/kernflux/opendsec/internal/sandboxid"
	"github.com/kernflux/opendsec/internal/sandboxspec"
	"github.com/kernflux/opendsec/internal/sandboxspec/specpb"
	"github.com/kernflux/opendsec/internal/sandboxspec/spectest"
)

// The node refuses the shared bad inputs with exactly sandboxspec's
// message (the apiserver's tests compare with the same one), then what
// only it knows: its backends and its size. Nothing is made.
func TestCreateValidationIsSandboxspec(t *testing.T) {
	n := openRecorded(t, &blockingRuntime{stopping: map[string]int{}, stops: map[string]int{}})
	svc := &service{n: n}
	create := func(p *opendsecv1.SandboxSpec) error {
		_, err := svc.CreateSandbox(t.Context(), connect.NewRequest(&nodev1.CreateSandboxRequest{SandboxId: sandboxid.New("t001"), Spec: nodeSpec(t, p)}))
		return errdefs.ToConnect(err) // what the server's interceptor answers
	}
	for _, b := range spectest.BadSpecs() {
		s, want := specpb.FromProto(b.Spec)
		if want == nil {
			_, want = sandboxspec.Normalize(s)
		}
		if want == nil {
			t.Fatalf("sandboxspec accepts %v", b.Spec)
		}
		var ce *connect.Error
		if err := create(b.Spec); !errors.As(err, &ce) || ce.Code() != connect.CodeInvalidArgument || ce.Message() != want.Error() {
			t.Errorf("create %v: err = %v, want invalid_argument %q", b.Spec, err, want)
		}
	}
	for _, tc := range []struct {
		spec *opendsecv1.SandboxSpec
		msg  string
	}{
		{&opendsecv1.SandboxSpec{Image: "root/busybox", Backend: "container"}, `backend: "container" is not available on node t001 (available: fake)`},
		{&opendsecv1.SandboxSpec{Image: "root/busybox", Cpu: 4.5}, "cpu: 4.5 cores exceeds the 4 of node t001; ask for at most 4"},
		{&opendsecv1.SandboxSpec{Image: "root/busybox", MemoryMb: proto.Int64(4097)}, "memory_mb: 4097 MiB exceeds the 4096 MiB of node t001; ask for at most 4096"},
		{&opendsecv1.SandboxSpec{Image: "root/busybox", AutoPause: true}, "auto_pause: the fake backend cannot pause"},
		{&opendsecv1.SandboxSpec{Image: "root/busybox", DiskMb: DefaultDiskMaxMB + 1}, "disk_mb: 51201 MiB exceeds the maximum of 51200 MiB on node t001 (node.disk.max_mb); ask for at most 51200"},
	} {
		var ce *connect.Error
		if err := create(tc.spec); !errors.As(err, &ce) || ce.Code() != connect.CodeInvalidArgument || !strings.HasPrefix(ce.Message(), tc.msg) {
			t.Errorf("create %v: err = %v, want invalid_argument starting %q", tc.spec, err, tc.msg)
		}
	}
	if _, _, c := n.Usage(); c != 0 {
		t.Fatalf("%d sandboxes after only bad input", c)
	}
}

// nodeSpec is the public spec p as the node's message. Both messages
// number the shared fields alike, so the wire form carries over (the
// apiserver maps field by field, internal/apiserver/nodemsg.go).
func nodeSpec(t *testing.T, p *opendsecv1.SandboxSpec) *nodev1.SandboxSpec {
	t.Helper()
	if p == nil {
		return nil
	}
	b, err := proto.Marshal(p)
	if err != nil {
		t.Fatal(err)
	}
	out := &nodev1.SandboxSpec{}
	if err := proto.Unmarshal(b, out); err != nil {
		t.Fatal(err)
	}
	return out
}

// Backend options in the node's spec reach the backend's check (the
// public spec has no field for them).
func TestCreateCarriesBackendOptions(t *testing.T) {
	n := openRecorded(t, &blockingRuntime{stopping: map[string]int{}, stops: map[string]int{}})
	svc := &service{n: n}
	_, err := svc.CreateSandbox(t.Context(), connect.NewRequest(&nodev1.CreateSandboxRequest{SandboxId: sandboxid.New("t001"),
		Spec: &nodev1.SandboxSpec{Image: "root/busybox", BackendOptions: map[string]string{"tier": "gold"}}}))
	err = errdefs.ToConnect(err) // what the server's interceptor answers
	var ce *connect.Error
	if !errors.As(err, &ce) || ce.Code() != connect.CodeInvalidArgument || !strings.HasPrefix(ce.Message(), "backend_options.tier: ") {
		t.Fatalf("create with backend_options {tier: gold}: err = %v, want the backend's invalid_argument naming backend_options.tier", err)
	}
}

type prestartFake struct{ blockingRuntime }

func (*prestartFake) Prestart(context.Context, string) error         { return nil }
func (*prestartFake) Launch(context.Context, string, []string) error { return nil }

type fixedImageID string

func (f fixedImageID) ImageID(context.Context, string) (string, error) { return string(f), nil }

// A spec with backend options has no warm-pool shape (options are not in
// the key, so a pooled sandbox made without them must not serve it).
func TestPoolKeyRefusesBackendOptions(t *testing.T) {
	p := &pool{n: &Node{cfg: Config{Backends: map[string]runtime.Runtime{"fake": &prestartFake{}}}}, ids: fixedImageID("sha256:1")}
	spec := specRecord{Backend: "fake", Image: "root/busybox", CPU: 1, MemoryMB: 512}
	if _, ok := p.key(t.Context(), spec); !ok {
		t.Fatal("a plain spec has no pool shape; the test does not reach the check")
	}
	spec.BackendOptions = map[string]string{"k": "v"}
	if _, ok := p.key(t.Context(), spec); ok {
		t.Fatal("a spec with backend options got a warm-pool shape")
	}
}

// A sandbox prestarted with no_new_privs must never serve a create that
// allows privilege escalation, nor the other way round: the two are
// different shapes.
func TestPoolKeySeparatesPrivilegeEscalation(t *testing.T) {
	p := &pool{n: &Node{cfg: Config{Backends: map[string]runtime.Runtime{"fake": &prestartFake{}}}}, ids: fixedImageID("sha256:1")}
	spec := specRecord{Backend: "fake", Image: "root/base", CPU: 1, MemoryMB: 512}
	plain, ok := p.key(t.Context(), spec)
	spec.AllowPrivilegeEscalation = true
	esc, ok2 := p.key(t.Context(), spec)
	if !ok || !ok2 {
		t.Fatal("a plain spec has no pool shape; the test does not reach the check")
	}
	if plain == esc {
		t.Fatal("allow_privilege_escalation true and false share a warm-pool shape")
	}
}

// TestSecurityPidsLimitNode: a pids_limit above the node's max_pids_limit
// is refused by the node before the backend runs, naming pids_limit, the
// limit and node.max_pids_limit; nothing is made. At the limit it runs.
func TestSecurityPidsLimitNode(t *testing.T) {
	f := newFakeNode(t, func(c *Config) { c.MaxPidsLimit = 2048 })
	_, err := f.Create(t.Context(), CreateRequest{ID: sandboxid.New(f.cfg.ID), Spec: specRecord{Image: "root/busybox", PidsLimit: 2049}})
	want := "pids_limit: 2049 processes exceeds the 2048 one sandbox may have on node t001 (node.max_pids_limit); ask for at most 2048"
	if !errdefs.IsInvalidArgument(err) || !strings.HasPrefix(err.Error(), want) {
		t.Fatalf("create with pids_limit 2049: %v; want invalid_argument %q", err, want)
	}
	if n := f.rt.Calls(runtimefake.OpCreate); n != 0 {
		t.Fatalf("the backend was asked to create %d sandboxes", n)
	}
	if _, _, c := f.Usage(); c != 0 {
		t.Fatalf("%d sandboxes after a refused create", c)
	}
	if rec := f.create(t, specRecord{PidsLimit: 2048}); rec.Spec.PidsLimit != 2048 {
		t.Fatalf("pids_limit at the node's max: %+v", rec.Spec)
	}
	// Unset, the node allows sandboxspec's default.
	d := newFakeNode(t)
	_, err = d.Create(t.Context(), CreateRequest{ID: sandboxid.New(d.cfg.ID), Spec: specRecord{Image: "root/busybox", PidsLimit: sandboxspec.DefaultMaxPidsLimit + 1}})
	if !errdefs.IsInvalidArgument(err) {
		t.Fatalf("pids_limit above the default max: %v", err)
	}
}
