package apiserver

import (
	"strings"
	"testing"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	v1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/internal/errdefs"
)

func field(num protowire.Number, v []byte) []byte {
	b := protowire.AppendTag(nil, num, protowire.BytesType)
	return protowire.AppendBytes(b, v)
}

func TestCodecNamesBadUTF8Field(t *testing.T) {
	bad := []byte("/tmp/\xff")
	for _, tc := range []struct {
		name  string
		wire  []byte
		msg   any
		field string
	}{
		// WriteFileRequest.header(1).path(2): nested.
		{"nested path", field(1, append(field(1, []byte("n001aaaaaaaaaaaaaaaa")), field(2, bad)...)), &v1.WriteFileRequest{}, "path"},
		// ExecRequest.start(1).env(3) map entry value(2).
		{"map value", field(1, field(3, append(field(1, []byte("K")), field(2, bad)...))), &v1.ExecRequest{}, "env"},
		// MoveRequest.destination(3).
		{"top level", append(field(2, []byte("/ok")), field(3, bad)...), &v1.MoveRequest{}, "destination"},
	} {
		err := protoCodec{}.Unmarshal(tc.wire, tc.msg)
		fe, ok := err.(*errdefs.FieldError)
		if !ok || fe.Field != tc.field {
			t.Errorf("%s: err = %v, want a field error naming %s", tc.name, err, tc.field)
		}
	}
	// Valid input still decodes.
	var m v1.MoveRequest
	if err := (protoCodec{}).Unmarshal(append(field(2, []byte("/a")), field(3, []byte("/b"))...), &m); err != nil || m.GetDestination() != "/b" {
		t.Fatalf("valid: %v %v", &m, err)
	}
}

// FuzzExecRequest decodes arbitrary bytes as an Exec stream's first
// message, as the handler does, and validates its start: a decode error or
// a field error, never a panic nor another category.
func FuzzExecRequest(f *testing.F) {
	for _, m := range []*v1.ExecRequest{
		{Msg: &v1.ExecRequest_Start{Start: &v1.ExecStart{SandboxId: "n001aaaaaaaaaaaaaaaa", Command: []string{"/bin/sh", "-c", "echo hi"},
			Env: map[string]string{"A": "b"}, Cwd: "/tmp", User: "user", TimeoutSeconds: 5, Stdin: true, Pty: &v1.PtySize{Cols: 80, Rows: 24}}}},
		{Msg: &v1.ExecRequest_Start{Start: &v1.ExecStart{Command: []string{""}}}},
		{Msg: &v1.ExecRequest_Stdin{Stdin: []byte("x")}},
	} {
		b, err := proto.Marshal(m)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		var m v1.ExecRequest
		if err := (protoCodec{}).Unmarshal(b, &m); err != nil {
			if !errdefs.IsInvalidArgument(err) && !strings.Contains(err.Error(), "proto") {
				t.Fatalf("decode error of another kind: %v", err)
			}
			return
		}
		if st := m.GetStart(); st != nil {
			if err := validateStart(st); err != nil && !errdefs.IsInvalidArgument(err) {
				t.Fatalf("validate %v: %v, want invalid_argument", st, err)
			}
		}
	})
}
