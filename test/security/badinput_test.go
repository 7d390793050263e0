//go:build linux

package security

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"

	"connectrpc.com/connect"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/test/harness"
)

func wantCode(t *testing.T, what string, err error, code connect.Code, mention ...string) {
	t.Helper()
	if err == nil {
		t.Errorf("%s: no error, want %s", what, code)
		return
	}
	ok := connect.CodeOf(err) == code
	for _, m := range mention {
		ok = ok && strings.Contains(err.Error(), m)
	}
	if !ok {
		t.Errorf("%s: got %v, want %s mentioning %q", what, err, code, mention)
	}
}

// TestSecurityBadInput (issue 11, finding 8): bad input through the public
// API and the E2B gateway of a real system is a categorized error naming
// the field and the limit — never internal, never accepted to fail later
// — and leaves nothing behind. The node's upload limit is 64 MiB
// (harness config).
func TestSecurityBadInput(t *testing.T) {
	s := harness.New(t)
	s.Start()
	ctx := t.Context()
	create := func(req *opendsecv1.CreateSandboxRequest) error {
		_, err := s.Sandboxes().CreateSandbox(ctx, connect.NewRequest(req))
		return err
	}
	busybox := func() *opendsecv1.SandboxSpec { return &opendsecv1.SandboxSpec{Image: "root/busybox"} }

	// A 100 KB request_id was "internal: record sandbox: key too large".
	wantCode(t, "100 KB request_id", create(&opendsecv1.CreateSandboxRequest{Spec: busybox(), RequestId: strings.Repeat("r", 100<<10)}),
		connect.CodeInvalidArgument, "request_id: is 102400 bytes; at most 128")
	// A user the image lacks was accepted; every exec failed later.
	spec := busybox()
	spec.User = "ghost"
	wantCode(t, "user not in the image", create(&opendsecv1.CreateSandboxRequest{Spec: spec}),
		connect.CodeInvalidArgument, `user: "ghost" does not exist in image root/busybox`)
	l, err := s.Sandboxes().ListSandboxes(ctx, connect.NewRequest(&opendsecv1.ListSandboxesRequest{}))
	if err != nil || len(l.Msg.GetSandboxes()) != 0 {
		t.Fatalf("sandboxes after refused creates: %v %v", l, err)
	}

	sb := s.Create(t, &opendsecv1.SandboxSpec{Image: "root/busybox", User: "user"})
	write := func(path string, size int64, chunks ...[]byte) error {
		st := s.Files().WriteFile(ctx)
		if err := st.Send(&opendsecv1.WriteFileRequest{Msg: &opendsecv1.WriteFileRequest_Header{Header: &opendsecv1.WriteFileHeader{SandboxId: sb.GetId(), Path: path, Size: size}}}); err != nil {
			_, err = st.CloseAndReceive()
			return err
		}
		for _, c := range chunks {
			if err := st.Send(&opendsecv1.WriteFileRequest{Msg: &opendsecv1.WriteFileRequest_Data{Data: c}}); err != nil {
				break
			}
		}
		_, err := st.CloseAndReceive()
		return err
	}
	// Writing the agent's binary was "internal ... device or resource busy".
	wantCode(t, "write /.opendsec/agent", write("/.opendsec/agent", 5, []byte("pwned")),
		connect.CodePermissionDenied, "'/.opendsec/agent'", "belongs to the sandbox's agent")
	// Over the upload limit: declared, and undeclared.
	wantCode(t, "declared 65 MiB upload", write("/tmp/big", 65<<20),
		connect.CodeResourceExhausted, "size: 68157440 bytes exceeds the upload limit of 67108864 bytes (64 MiB, node.max_upload_mb)")
	chunk := bytes.Repeat([]byte("x"), 1<<20)
	var chunks [][]byte
	for range 65 {
		chunks = append(chunks, chunk)
	}
	wantCode(t, "undeclared 65 MiB upload", write("/tmp/big", 0, chunks...),
		connect.CodeResourceExhausted, "over the upload limit of 67108864 bytes")
	if r := s.Shell(t, sb.GetId(), "ls /tmp/big 2>/dev/null; test -s /.opendsec/agent && echo agent intact"); r.Stdout != "agent intact\n" {
		t.Errorf("after refused writes: %q", r.Stdout)
	}

	// The E2B gateway: create, then its /files (the agent's POST /files,
	// which E2B's SDKs write through).
	key := strings.TrimSpace(s.Run("e2b", "key", "create", "--principal", "alice"))
	e2b := func(method, path string, body io.Reader, hdr map[string]string) (int, string) {
		t.Helper()
		req, err := http.NewRequestWithContext(ctx, method, "http://"+s.E2BAddr()+path, body)
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("X-API-Key", key)
		for k, v := range hdr {
			req.Header.Set(k, v)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	code, body := e2b("POST", "/sandboxes", strings.NewReader(`{"templateID":"root/busybox","envVars":{"A":"`+strings.Repeat("x", 200<<10)+`"}}`), nil)
	if code != http.StatusBadRequest || !strings.Contains(body, "envVars:") || !strings.Contains(body, "at most 131071") {
		t.Errorf("E2B create with a 200 KiB envVar: %d %s, want 400 naming envVars and the limit", code, body)
	}
	code, body = e2b("POST", "/sandboxes", strings.NewReader(`{"templateID":"root/busybox"}`), nil)
	if code != http.StatusCreated {
		t.Fatalf("E2B create: %d %s", code, body)
	}
	var created struct{ SandboxID, EnvdAccessToken string }
	if err := json.Unmarshal([]byte(body), &created); err != nil {
		t.Fatal(err)
	}
	envd := map[string]string{"E2b-Sandbox-Id": created.SandboxID, "E2b-Sandbox-Port": "49983", "X-Access-Token": created.EnvdAccessToken,
		"Content-Type": "application/octet-stream"}
	code, body = e2b("POST", "/files?path=/.opendsec/agent", strings.NewReader("pwned"), envd)
	if code != http.StatusForbidden || !strings.Contains(body, "/.opendsec/agent") {
		t.Errorf("E2B /files onto the agent: %d %s, want 403 naming the path", code, body)
	}
	code, body = e2b("POST", "/files?path=/tmp/big", bytes.NewReader(make([]byte, 65<<20)), envd)
	if code != http.StatusRequestEntityTooLarge || !strings.Contains(body, "exceeds the limit of 67108864 bytes") {
		t.Errorf("E2B /files of 65 MiB: %d %s, want 413 naming the 64 MiB limit", code, body)
	}
	// Without a Content-Length (chunked): the agent answers 413 once it read
	// the limit; that answer was lost to a broken pipe (503).
	code, body = e2b("POST", "/files?path=/tmp/big", io.MultiReader(bytes.NewReader(make([]byte, 65<<20))), envd)
	if code != http.StatusRequestEntityTooLarge || !strings.Contains(body, "exceeds the limit of 67108864 bytes") {
		t.Errorf("E2B /files of 65 MiB, chunked: %d %s, want 413 naming the 64 MiB limit", code, body)
	}
	if r := s.Shell(t, created.SandboxID, "ls /tmp/big 2>/dev/null; echo done"); r.Stdout != "done\n" {
		t.Errorf("refused uploads left a file: %q", r.Stdout)
	}
	if code, body := e2b("DELETE", "/sandboxes/"+created.SandboxID, nil, nil); code != http.StatusNoContent {
		t.Errorf("E2B kill: %d %s", code, body)
	}
}
