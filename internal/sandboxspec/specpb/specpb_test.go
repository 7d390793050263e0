package specpb_test

import (
	"errors"
	"testing"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	v1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/sandboxspec"
	"github.com/kernflux/opendsec/internal/sandboxspec/specpb"
)

// full sets every field of SandboxSpec to a non-zero value by reflection,
// so a field added to the proto and forgotten in the mapping fails here.
func full(t *testing.T) *v1.SandboxSpec {
	t.Helper()
	p := &v1.SandboxSpec{}
	m := p.ProtoReflect()
	fields := m.Descriptor().Fields()
	for i := range fields.Len() {
		fd := fields.Get(i)
		switch {
		case fd.IsMap():
			mp := m.Mutable(fd).Map()
			mp.Set(protoreflect.ValueOfString(string(fd.Name())+"-k").MapKey(), protoreflect.ValueOfString("v"))
		case fd.Kind() == protoreflect.StringKind:
			m.Set(fd, protoreflect.ValueOfString(string(fd.Name())+"-value"))
		case fd.Kind() == protoreflect.DoubleKind:
			m.Set(fd, protoreflect.ValueOfFloat64(2.5))
		case fd.Kind() == protoreflect.Int64Kind:
			m.Set(fd, protoreflect.ValueOfInt64(int64(100+i)))
		case fd.Kind() == protoreflect.BoolKind:
			m.Set(fd, protoreflect.ValueOfBool(true))
		case fd.Message() != nil && fd.Message().FullName() == "opendsec.v1.NetworkPolicy":
			m.Set(fd, protoreflect.ValueOfMessage((&v1.NetworkPolicy{
				RuleSets: []string{"pypi", "github"},
				Allow: []*v1.NetworkRule{
					{Cidr: "10.0.0.0/8", Protocol: "tcp", Ports: "443"},
					{Domain: "*.example.com", Protocol: "udp", Ports: "53-54"},
				},
			}).ProtoReflect()))
		default:
			t.Fatalf("field %s (%s) has no test value: extend full() and the mapping", fd.Name(), fd.Kind())
		}
	}
	return p
}

func TestRoundTrip(t *testing.T) {
	in := full(t)
	s, err := specpb.FromProto(in)
	if err != nil {
		t.Fatal(err)
	}
	if out := specpb.ToProto(s); !proto.Equal(in, out) {
		t.Fatalf("proto → Spec → proto lost something:\n in  %v\n out %v", in, out)
	}
	// Unset stays unset: memory_mb (optional) and network (nil: the node's default).
	s, err = specpb.FromProto(&v1.SandboxSpec{Image: "x"})
	if err != nil {
		t.Fatal(err)
	}
	if s.MemoryMB != 0 || s.Network != nil {
		t.Fatalf("unset fields mapped to %+v", s)
	}
	if out := specpb.ToProto(s); out.MemoryMb != nil || out.Network != nil {
		t.Fatalf("unset fields came back set: %v", out)
	}
	// An empty policy is not no policy.
	s, _ = specpb.FromProto(&v1.SandboxSpec{Image: "x", Network: &v1.NetworkPolicy{}})
	if s.Network == nil || specpb.ToProto(s).Network == nil {
		t.Fatal("an empty network policy became the node's default")
	}
}

// Normalized specs go back to proto with their defaults.
func TestToProtoNormalized(t *testing.T) {
	s, err := specpb.FromProto(&v1.SandboxSpec{Image: "x"})
	if err != nil {
		t.Fatal(err)
	}
	if s, err = sandboxspec.Normalize(s); err != nil {
		t.Fatal(err)
	}
	p := specpb.ToProto(s)
	if p.GetMemoryMb() != 512 || p.MemoryMb == nil || p.GetCpu() != 1 || p.GetTimeoutSeconds() != 300 || p.GetPidsLimit() != 1024 {
		t.Fatalf("normalized proto %v, want the defaults", p)
	}
}

func TestFromProtoRefuses(t *testing.T) {
	for _, tc := range []struct {
		field string
		p     *v1.SandboxSpec
	}{
		{"spec", nil},
		{"memory_mb", &v1.SandboxSpec{Image: "x", MemoryMb: proto.Int64(0)}},
	} {
		_, err := specpb.FromProto(tc.p)
		var fe *errdefs.FieldError
		if !errors.As(err, &fe) || fe.Field != tc.field {
			t.Errorf("%v: err = %v, want invalid argument naming %s", tc.p, err, tc.field)
		}
	}
}
