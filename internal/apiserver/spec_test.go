package apiserver_test

import (
	"errors"
	"testing"

	"connectrpc.com/connect"

	v1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/internal/sandboxspec"
	"github.com/kernflux/opendsec/internal/sandboxspec/specpb"
	"github.com/kernflux/opendsec/internal/sandboxspec/spectest"
)

// specErr is sandboxspec's answer for p (the node's tests compare with the
// same one).
func specErr(p *v1.SandboxSpec) error {
	s, err := specpb.FromProto(p)
	if err != nil {
		return err
	}
	_, err = sandboxspec.Normalize(s)
	return err
}

// The apiserver refuses the shared bad inputs with exactly sandboxspec's
// message, for single and batch creates, and creates nothing.
func TestCreateValidationIsSandboxspec(t *testing.T) {
	e := setup(t, nil, "n001")
	for _, b := range spectest.BadSpecs() {
		want := specErr(b.Spec)
		if want == nil {
			t.Fatalf("sandboxspec accepts %v", b.Spec)
		}
		_, err := e.sbx.CreateSandbox(t.Context(), connect.NewRequest(&v1.CreateSandboxRequest{Spec: b.Spec}))
		var ce *connect.Error
		if !errors.As(err, &ce) || ce.Code() != connect.CodeInvalidArgument || ce.Message() != want.Error() {
			t.Errorf("create %v: err = %v, want invalid_argument %q", b.Spec, err, want)
		}
		stream, err := e.sbx.BatchCreateSandboxes(t.Context(), connect.NewRequest(&v1.BatchCreateSandboxesRequest{Spec: b.Spec, Count: 2}))
		if err == nil {
			for stream.Receive() {
			}
			err = stream.Err()
		}
		if !errors.As(err, &ce) || ce.Code() != connect.CodeInvalidArgument || ce.Message() != want.Error() {
			t.Errorf("batch create %v: err = %v, want invalid_argument %q", b.Spec, err, want)
		}
	}
	if c, live := e.nodes[0].count(); c != 0 || live != 0 {
		t.Fatalf("node got %d creates (%d live) from only bad input", c, live)
	}
}
