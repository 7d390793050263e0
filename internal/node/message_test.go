package node

import (
	"testing"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	nodev1 "github.com/kernflux/opendsec/api/gen/opendsec/node/v1"
	"github.com/kernflux/opendsec/internal/runtime/runtimefake"
	"github.com/kernflux/opendsec/internal/sandboxid"
	"github.com/kernflux/opendsec/internal/sandboxspec/specpb"
)

// The node's Sandbox message carries every field of the record it has room
// for: each field is set, but for those only some sandboxes have.
func TestSandboxMessageCarriesTheRecord(t *testing.T) {
	f := newFakeNode(t)
	rec, err := f.Create(t.Context(), CreateRequest{ID: sandboxid.New("t001"), Owner: "alice", Project: "rl",
		Spec: specRecord{Image: "root/busybox", TimeoutSec: 600, Labels: map[string]string{"team": "rl"}, TaskID: "job"}})
	if err != nil {
		t.Fatal(err)
	}
	_, sb, err := f.Get(t.Context(), rec.ID)
	if err != nil {
		t.Fatal(err)
	}
	p := f.toProto(sb)
	unsetHere := map[protoreflect.Name]string{
		"reason":            "set when the sandbox failed",
		"from_warm_pool":    "this one was made from scratch",
		"parent_id":         "it was made from an image, not forked (fork_test.go checks forks set it)",
		"paused_filesystem": "it runs (fspause_test.go checks a filesystem-paused one through Get)",
	}
	fields := p.ProtoReflect().Descriptor().Fields()
	for i := range fields.Len() {
		fd := fields.Get(i)
		if _, ok := unsetHere[fd.Name()]; !ok && !p.ProtoReflect().Has(fd) {
			t.Errorf("field %s is not set from the record", fd.Name())
		}
	}
	if p.GetId() != rec.ID || p.GetNodeId() != "t001" || p.GetBackend() != runtimefake.Name || p.GetOwner() != "alice" || p.GetProject() != "rl" ||
		p.GetState() != nodev1.SandboxState_SANDBOX_STATE_RUNNING || !p.GetExpiresAt().AsTime().Equal(rec.ExpiresAt) {
		t.Errorf("sandbox message %v does not match record %+v", p, rec)
	}
	if !proto.Equal(p.GetSpec(), specpb.ToNode(rec.Spec)) {
		t.Errorf("spec %v, want the record's %+v", p.GetSpec(), rec.Spec)
	}
}
