package apiserver

import (
	"fmt"
	"testing"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	nodev1 "github.com/kernflux/opendsec/api/gen/opendsec/node/v1"
	v1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/internal/sandboxspec/specpb"
	"github.com/kernflux/opendsec/internal/sandboxspec/spectest"
)

// nodeOnly are the node.v1 fields the public API does not have (yet); the
// mapping drops them. A node field that is neither here nor in the public
// message fails the tests below, so adding one is a decision.
var nodeOnly = map[protoreflect.FullName]bool{
	"opendsec.node.v1.Sandbox.backend":             true,
	"opendsec.node.v1.SandboxSpec.backend_options": true,
}

// idIsSandboxID: public requests name the sandbox "id", node requests
// "sandbox_id".
var idIsSandboxID = map[protoreflect.Name]protoreflect.Name{"id": "sandbox_id"}

// sameByName checks that pub carries, field by field and by name, what
// node carries: every public field has a node field of the same name
// (after renamed) and kind holding the same value (enums by value name),
// and every node field is in pub or in nodeOnly (extra lists more
// node-only field names for this pair).
func sameByName(t *testing.T, where string, pub, node protoreflect.Message, renamed map[protoreflect.Name]protoreflect.Name, extra ...protoreflect.Name) {
	t.Helper()
	nd := node.Descriptor()
	seen := map[protoreflect.Name]bool{}
	for _, n := range extra {
		seen[n] = true
	}
	pfs := pub.Descriptor().Fields()
	for i := range pfs.Len() {
		pf := pfs.Get(i)
		name := pf.Name()
		if r, ok := renamed[name]; ok {
			name = r
		}
		nf := nd.Fields().ByName(name)
		if nf == nil {
			t.Errorf("%s: public field %s has no node field %s", where, pf.FullName(), name)
			continue
		}
		seen[name] = true
		if pf.Kind() != nf.Kind() || pf.Cardinality() != nf.Cardinality() || pf.IsMap() != nf.IsMap() {
			t.Errorf("%s.%s: public %s %s, node %s %s", where, name, pf.Cardinality(), pf.Kind(), nf.Cardinality(), nf.Kind())
			continue
		}
		if pf.HasPresence() && pub.Has(pf) != node.Has(nf) {
			t.Errorf("%s.%s: set in public %v, in node %v", where, name, pub.Has(pf), node.Has(nf))
			continue
		}
		sameValue(t, where+"."+string(name), pf, pub.Get(pf), nf, node.Get(nf))
	}
	nfs := nd.Fields()
	for i := range nfs.Len() {
		if nf := nfs.Get(i); !seen[nf.Name()] && !nodeOnly[nf.FullName()] {
			t.Errorf("%s: node field %s is neither mapped to %s nor listed as node-only", where, nf.FullName(), pub.Descriptor().FullName())
		}
	}
}

func sameValue(t *testing.T, where string, pf protoreflect.FieldDescriptor, pv protoreflect.Value, nf protoreflect.FieldDescriptor, nv protoreflect.Value) {
	t.Helper()
	elem := func(where string, pv, nv protoreflect.Value) {
		switch {
		case pf.Message() != nil && !pf.IsMap():
			sameByName(t, where, pv.Message(), nv.Message(), nil)
		case pf.Kind() == protoreflect.EnumKind:
			pn := pf.Enum().Values().ByNumber(pv.Enum())
			nn := nf.Enum().Values().ByNumber(nv.Enum())
			if pn == nil || nn == nil || pn.Name() != nn.Name() {
				t.Errorf("%s: public %v, node %v", where, pn, nn)
			}
		default:
			if pv.Interface() != nv.Interface() {
				t.Errorf("%s: public %v, node %v", where, pv, nv)
			}
		}
	}
	switch {
	case pf.IsMap():
		pm, nm := pv.Map(), nv.Map()
		if pm.Len() != nm.Len() {
			t.Errorf("%s: public has %d entries, node %d", where, pm.Len(), nm.Len())
			return
		}
		pm.Range(func(k protoreflect.MapKey, v protoreflect.Value) bool {
			if !nm.Has(k) {
				t.Errorf("%s[%v]: not in node", where, k)
				return true
			}
			if pf.MapValue().Message() != nil {
				sameByName(t, fmt.Sprintf("%s[%v]", where, k), v.Message(), nm.Get(k).Message(), nil)
			} else if v.Interface() != nm.Get(k).Interface() {
				t.Errorf("%s[%v]: public %v, node %v", where, k, v, nm.Get(k))
			}
			return true
		})
	case pf.IsList():
		pl, nl := pv.List(), nv.List()
		if pl.Len() != nl.Len() {
			t.Errorf("%s: public has %d elements, node %d", where, pl.Len(), nl.Len())
			return
		}
		for i := range pl.Len() {
			elem(fmt.Sprintf("%s[%d]", where, i), pl.Get(i), nl.Get(i))
		}
	default:
		elem(where, pv, nv)
	}
}

// Every field of a public spec survives the trip to the node's record and
// back: public → node.v1 → record → node.v1 → public.
func TestSpecSurvivesTheNode(t *testing.T) {
	through := func(p *v1.SandboxSpec) *v1.SandboxSpec {
		t.Helper()
		ns := nodeSpec(p)
		if len(ns.GetBackendOptions()) != 0 {
			t.Fatalf("backend options from a public spec: %v", ns.GetBackendOptions())
		}
		rec, err := specpb.FromNode(ns)
		if err != nil {
			t.Fatal(err)
		}
		return publicSpec(specpb.ToNode(rec))
	}
	in := spectest.Fill(&v1.SandboxSpec{})
	sameByName(t, "SandboxSpec", in.ProtoReflect(), nodeSpec(in).ProtoReflect(), nil)
	if out := through(in); !proto.Equal(in, out) {
		t.Fatalf("public → node → record → node → public lost something:\n in  %v\n out %v", in, out)
	}
	// Unset stays unset (memory_mb: the default; network: the node's
	// default) and an empty policy (deny all) stays empty.
	if out := through(&v1.SandboxSpec{Image: "x"}); out.MemoryMb != nil || out.Network != nil {
		t.Fatalf("unset fields came back set: %v", out)
	}
	if out := through(&v1.SandboxSpec{Image: "x", Network: &v1.NetworkPolicy{}}); out.Network == nil {
		t.Fatal("an empty network policy became the node's default")
	}
	// An explicit memory_mb of 0 reaches the node as such (it refuses it).
	if ns := nodeSpec(&v1.SandboxSpec{Image: "x", MemoryMb: proto.Int64(0)}); ns.MemoryMb == nil || *ns.MemoryMb != 0 {
		t.Fatalf("explicit memory_mb 0 became %v", ns.MemoryMb)
	}
	if nodeSpec(nil) != nil || publicSpec(nil) != nil {
		t.Fatal("a missing spec became a spec")
	}
}

// Every field of the node's answers reaches the public answer where the
// public message has it; node-only fields are dropped.
func TestNodeAnswersMapToPublic(t *testing.T) {
	n := spectest.Fill(&nodev1.Sandbox{})
	p := publicSandbox(n)
	sameByName(t, "Sandbox", p.ProtoReflect(), n.ProtoReflect(), nil)

	// The public answer is what a node sending opendsec.v1.Sandbox gave
	// before node.v1 had its own messages: the shared fields keep their
	// numbers, so the node's message without its node-only fields reads as
	// the public one.
	old := proto.Clone(n).(*nodev1.Sandbox)
	old.Backend, old.Spec.BackendOptions = "", nil
	b, err := proto.Marshal(old)
	if err != nil {
		t.Fatal(err)
	}
	want := &v1.Sandbox{}
	if err := proto.Unmarshal(b, want); err != nil { // node-only fields left would stay as unknown fields and fail Equal
		t.Fatal(err)
	}
	if !proto.Equal(p, want) {
		t.Fatalf("public sandbox\n %v\nwant\n %v", p, want)
	}

	m := spectest.Fill(&nodev1.SandboxMetrics{})
	sameByName(t, "SandboxMetrics", publicMetrics(m).ProtoReflect(), m.ProtoReflect(), nil)

	pr := spectest.Fill(&nodev1.PauseSandboxesResponse{})
	sameByName(t, "PauseSandboxesResponse", (&v1.PauseSandboxesResponse{Sandboxes: publicSandboxes(pr.Sandboxes), Failures: publicFailures(pr.Failures),
		Reclaimed: publicReclaims(pr.Reclaimed), BytesFreed: pr.BytesFreed}).ProtoReflect(), pr.ProtoReflect(), nil)
	rr := spectest.Fill(&nodev1.ResumeSandboxesResponse{})
	sameByName(t, "ResumeSandboxesResponse", (&v1.ResumeSandboxesResponse{Sandboxes: publicSandboxes(rr.Sandboxes), Failures: publicFailures(rr.Failures)}).ProtoReflect(), rr.ProtoReflect(), nil)

	fr := spectest.Fill(&nodev1.ForkSandboxResponse{})
	fr.Forks = append(fr.Forks, spectest.Fill(&nodev1.ForkResult{}), spectest.Fill(&nodev1.ForkResult{}))
	pf := publicForks(fr)
	if pf.GetSourceFrozenUs() != fr.GetSourceFrozenUs() || len(pf.GetForks()) != len(fr.GetForks()) {
		t.Fatalf("fork answer %v from %v", pf, fr)
	}
	for i, f := range pf.GetForks() {
		sameByName(t, "ForkResult", f.ProtoReflect(), fr.Forks[i].ProtoReflect(), nil)
		if !proto.Equal(f.GetSandbox(), publicSandbox(fr.Forks[i].GetSandbox())) || f.GetMemoryPreserved() != fr.Forks[i].GetMemoryPreserved() {
			t.Errorf("fork %d: %v from %v", i, f, fr.Forks[i])
		}
	}
	if publicSandbox(nil) != nil || publicSandboxes(nil) != nil || publicMetrics(nil) != nil || publicFailures(nil) != nil || publicReclaims(nil) != nil {
		t.Fatal("a missing answer became an answer")
	}
}

// Every field of a public request reaches the node's request.
func TestPublicRequestsMapToNode(t *testing.T) {
	cr := spectest.Fill(&v1.CreateSandboxRequest{})
	nc := nodeCreateRequest("n001aaaaaaaaaaaaaaaa", cr.Spec, cr.RequestId, cr.SkipWarmPool)
	sameByName(t, "CreateSandboxRequest", cr.ProtoReflect(), nc.ProtoReflect(), nil, "sandbox_id")
	if nc.SandboxId != "n001aaaaaaaaaaaaaaaa" {
		t.Errorf("create: sandbox_id %q", nc.SandboxId)
	}
	st := spectest.Fill(&v1.SetTimeoutRequest{})
	sameByName(t, "SetTimeoutRequest", st.ProtoReflect(), nodeSetTimeoutRequest(st).ProtoReflect(), idIsSandboxID)
	sn := spectest.Fill(&v1.SetNetworkRequest{})
	sameByName(t, "SetNetworkRequest", sn.ProtoReflect(), nodeSetNetworkRequest(sn).ProtoReflect(), idIsSandboxID)
	pa := spectest.Fill(&v1.PauseSandboxRequest{})
	sameByName(t, "PauseSandboxRequest", pa.ProtoReflect(), nodePauseRequest(pa).ProtoReflect(), idIsSandboxID)
	re := spectest.Fill(&v1.ResumeSandboxRequest{})
	sameByName(t, "ResumeSandboxRequest", re.ProtoReflect(), nodeResumeRequest(re).ProtoReflect(), idIsSandboxID)
	me := spectest.Fill(&v1.GetSandboxMetricsRequest{})
	sameByName(t, "GetSandboxMetricsRequest", me.ProtoReflect(), nodeMetricsRequest(me).ProtoReflect(), idIsSandboxID)
	ge := spectest.Fill(&v1.GetSandboxRequest{})
	sameByName(t, "GetSandboxRequest", ge.ProtoReflect(), nodeGetRequest(ge.GetId()).ProtoReflect(), idIsSandboxID)
	so := spectest.Fill(&v1.StopSandboxRequest{})
	sameByName(t, "StopSandboxRequest", so.ProtoReflect(), nodeStopRequest(so.GetId()).ProtoReflect(), idIsSandboxID)
	fo := spectest.Fill(&v1.ForkSandboxRequest{})
	sameByName(t, "ForkSandboxRequest", fo.ProtoReflect(), nodeForkRequest(fo).ProtoReflect(), nil)
	pb := spectest.Fill(&v1.PauseSandboxesRequest{})
	sameByName(t, "PauseSandboxesRequest", pb.ProtoReflect(), nodePauseBatchRequest(pb.Selector, pb.Reclaim).ProtoReflect(), nil)
	rb := spectest.Fill(&v1.ResumeSandboxesRequest{})
	sameByName(t, "ResumeSandboxesRequest", rb.ProtoReflect(), nodeResumeBatchRequest(rb.Selector, rb.TimeoutSeconds).ProtoReflect(), nil)
	if nodeNetwork(nil) != nil || nodeSelector(nil) != nil {
		t.Fatal("a missing policy or selector became one")
	}
	if np := nodeNetwork(new(v1.NetworkPolicy)); np == nil {
		t.Fatal("an empty network policy (deny all) became the node's default")
	}
}

// Every node state is the public state of the same name; a number the
// public enum does not have is UNSPECIFIED.
func TestStatesMapByName(t *testing.T) {
	reached := map[v1.SandboxState]bool{}
	vs := nodev1.SandboxState(0).Descriptor().Values()
	for i := range vs.Len() {
		s := nodev1.SandboxState(vs.Get(i).Number())
		p := publicState(s)
		if p.String() != s.String() {
			t.Errorf("node state %s became public %s", s, p)
		}
		reached[p] = true
	}
	if len(reached) != len(v1.SandboxState_name) {
		t.Errorf("node states reach %d public states of %d", len(reached), len(v1.SandboxState_name))
	}
	if p := publicState(nodev1.SandboxState(99)); p != v1.SandboxState_SANDBOX_STATE_UNSPECIFIED {
		t.Errorf("unknown node state became %s", p)
	}
}
