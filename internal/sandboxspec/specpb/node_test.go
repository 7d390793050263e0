package specpb_test

import (
	"errors"
	"testing"

	"google.golang.org/protobuf/proto"

	nodev1 "github.com/kernflux/opendsec/api/gen/opendsec/node/v1"
	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/sandboxspec/specpb"
	"github.com/kernflux/opendsec/internal/sandboxspec/spectest"
)

// Every field of the node's spec, backend options included, survives the
// node's record (sandboxspec.Spec) and back.
func TestNodeRoundTrip(t *testing.T) {
	in := spectest.Fill(&nodev1.SandboxSpec{})
	s, err := specpb.FromNode(in)
	if err != nil {
		t.Fatal(err)
	}
	if s.BackendOptions["backend_options-k"] != "backend_options-v" {
		t.Fatalf("backend options not in the record: %v", s.BackendOptions)
	}
	if out := specpb.ToNode(s); !proto.Equal(in, out) {
		t.Fatalf("node spec → Spec → node spec lost something:\n in  %v\n out %v", in, out)
	}
	// Unset stays unset (memory_mb: the default; network: the node's
	// default), and an empty policy (deny all) stays empty.
	s, err = specpb.FromNode(&nodev1.SandboxSpec{Image: "x"})
	if err != nil {
		t.Fatal(err)
	}
	if out := specpb.ToNode(s); s.MemoryMB != 0 || s.Network != nil || out.MemoryMb != nil || out.Network != nil {
		t.Fatalf("unset fields came back set: %+v, %v", s, out)
	}
	s, _ = specpb.FromNode(&nodev1.SandboxSpec{Image: "x", Network: &nodev1.NetworkPolicy{}})
	if s.Network == nil || specpb.ToNode(s).Network == nil {
		t.Fatal("an empty network policy became the node's default")
	}
}

func TestFromNodeRefuses(t *testing.T) {
	for _, tc := range []struct {
		field string
		p     *nodev1.SandboxSpec
	}{
		{"spec", nil},
		{"memory_mb", &nodev1.SandboxSpec{Image: "x", MemoryMb: proto.Int64(0)}},
	} {
		_, err := specpb.FromNode(tc.p)
		var fe *errdefs.FieldError
		if !errors.As(err, &fe) || fe.Field != tc.field {
			t.Errorf("%v: err = %v, want invalid argument naming %s", tc.p, err, tc.field)
		}
	}
}
