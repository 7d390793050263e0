package apiserver_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	v1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/api/gen/opendsec/v1/opendsecv1connect"
	"github.com/kernflux/opendsec/internal/apiserver"
	"github.com/kernflux/opendsec/internal/sandboxspec"
)

// TestSecurityBadInputCreateBounds: every string, map and list of a create
// request is bounded at the edge, refused as invalid_argument naming the
// field and the limit, before any node sees it (issue 11, finding 8: a
// 100 KB request_id was "internal: record sandbox: key too large").
func TestSecurityBadInputCreateBounds(t *testing.T) {
	e := setup(t, nil, "n001")
	many := func(n int, f func(i int) (string, string)) map[string]string {
		m := map[string]string{}
		for i := range n {
			k, v := f(i)
			m[k] = v
		}
		return m
	}
	rules := func(n int) *v1.NetworkPolicy {
		p := &v1.NetworkPolicy{}
		for i := range n {
			p.Allow = append(p.Allow, &v1.NetworkRule{Cidr: fmt.Sprintf("10.%d.%d.0/24", i>>8&255, i&255)})
		}
		return p
	}
	for _, tc := range []struct {
		name, field, limit string
		req                *v1.CreateSandboxRequest
	}{
		{"100 KB request_id", "request_id", "at most 128", &v1.CreateSandboxRequest{Spec: busybox(), RequestId: strings.Repeat("r", 100<<10)}},
		{"request_id with a newline", "request_id", "control character", &v1.CreateSandboxRequest{Spec: busybox(), RequestId: "a\nb"}},
		{"long image", "image", "at most 1024", &v1.CreateSandboxRequest{Spec: &v1.SandboxSpec{Image: strings.Repeat("a", 100<<10)}}},
		{"many labels", "labels", "at most 128", &v1.CreateSandboxRequest{Spec: &v1.SandboxSpec{Image: "root/busybox",
			Labels: many(129, func(i int) (string, string) { return fmt.Sprintf("k%d", i), "v" })}}},
		{"long label value", "labels", "at most 256", &v1.CreateSandboxRequest{Spec: &v1.SandboxSpec{Image: "root/busybox", Labels: map[string]string{"k": strings.Repeat("v", 257)}}}},
		{"long label key", "labels", "1-63", &v1.CreateSandboxRequest{Spec: &v1.SandboxSpec{Image: "root/busybox", Labels: map[string]string{strings.Repeat("k", 64): "v"}}}},
		{"many env vars", "env", "at most 4096", &v1.CreateSandboxRequest{Spec: &v1.SandboxSpec{Image: "root/busybox",
			Env: many(4097, func(i int) (string, string) { return fmt.Sprintf("V%d", i), "" })}}},
		{"huge env value", "env", "at most 131071", &v1.CreateSandboxRequest{Spec: &v1.SandboxSpec{Image: "root/busybox", Env: map[string]string{"A": strings.Repeat("x", 200<<10)}}}},
		{"long task_id", "task_id", "at most 128", &v1.CreateSandboxRequest{Spec: &v1.SandboxSpec{Image: "root/busybox", TaskId: strings.Repeat("t", 100<<10)}}},
		{"long user", "user", "at most 32", &v1.CreateSandboxRequest{Spec: &v1.SandboxSpec{Image: "root/busybox", User: strings.Repeat("u", 100)}}},
		{"long workdir", "workdir", "at most 4096", &v1.CreateSandboxRequest{Spec: &v1.SandboxSpec{Image: "root/busybox", Workdir: "/" + strings.Repeat("w", 100<<10)}}},
		{"many rule sets", "network.rule_sets", "at most 64", &v1.CreateSandboxRequest{Spec: &v1.SandboxSpec{Image: "root/busybox",
			Network: &v1.NetworkPolicy{RuleSets: strings.Split(strings.Repeat("pypi,", 65), ",")[:65]}}}},
		{"long rule set name", "network.rule_sets[0]", "at most 255", &v1.CreateSandboxRequest{Spec: &v1.SandboxSpec{Image: "root/busybox",
			Network: &v1.NetworkPolicy{RuleSets: []string{strings.Repeat("p", 100<<10)}}}}},
		{"many rules", "network.allow", "at most 4096", &v1.CreateSandboxRequest{Spec: &v1.SandboxSpec{Image: "root/busybox", Network: rules(4097)}}},
		{"long domain", "network.allow[0].domain", "at most 255", &v1.CreateSandboxRequest{Spec: &v1.SandboxSpec{Image: "root/busybox",
			Network: &v1.NetworkPolicy{Allow: []*v1.NetworkRule{{Domain: strings.Repeat("a", 100<<10) + ".com"}}}}}},
	} {
		_, err := e.sbx.CreateSandbox(t.Context(), connect.NewRequest(tc.req))
		if connect.CodeOf(err) != connect.CodeInvalidArgument || !strings.HasPrefix(connectMessage(err), tc.field+":") || !strings.Contains(err.Error(), tc.limit) {
			t.Errorf("%s: got %v, want invalid_argument %q naming %q", tc.name, err, tc.field, tc.limit)
		}
	}
	// A batch's request_id too.
	st, err := e.sbx.BatchCreateSandboxes(t.Context(), connect.NewRequest(&v1.BatchCreateSandboxesRequest{Spec: busybox(), Count: 2, RequestId: strings.Repeat("r", 100<<10)}))
	if err == nil {
		for st.Receive() {
		}
		err = st.Err()
	}
	if connect.CodeOf(err) != connect.CodeInvalidArgument || !strings.HasPrefix(connectMessage(err), "request_id:") {
		t.Errorf("batch with a 100 KB request_id: %v, want invalid_argument naming request_id", err)
	}
	if creates, _ := e.nodes[0].count(); creates != 0 {
		t.Fatalf("the node saw %d creates for refused requests", creates)
	}
	// The limits themselves are accepted.
	ok := &v1.CreateSandboxRequest{Spec: &v1.SandboxSpec{Image: "root/busybox",
		Labels: many(sandboxspec.MaxLabels, func(i int) (string, string) { return fmt.Sprintf("k%d", i), "v" })},
		RequestId: strings.Repeat("r", sandboxspec.MaxRequestIDLen)}
	if _, err := e.sbx.CreateSandbox(t.Context(), connect.NewRequest(ok)); err != nil {
		t.Fatalf("create at the limits: %v", err)
	}
}

// TestSecurityBadInputExecBounds: an exec's command and cwd are bounded at
// the edge (the kernel refuses one argument over 128 KiB with E2BIG, which
// reached the caller as an internal error).
func TestSecurityBadInputExecBounds(t *testing.T) {
	e := setup(t, nil, "n001")
	id := e.create(busybox()).GetId()
	for _, tc := range []struct {
		name, field, limit string
		start              *v1.ExecStart
	}{
		{"200 KiB argument", "command", "at most 131071", &v1.ExecStart{SandboxId: id, Command: []string{"echo", strings.Repeat("x", 200<<10)}}},
		{"many arguments", "command", "at most 4096", &v1.ExecStart{SandboxId: id, Command: strings.Split(strings.Repeat("a,", 5000), ",")}},
		{"long cwd", "cwd", "at most 4096", &v1.ExecStart{SandboxId: id, Command: []string{"true"}, Cwd: "/" + strings.Repeat("c", 10000)}},
	} {
		_, err := e.run(tc.start)
		if connect.CodeOf(err) != connect.CodeInvalidArgument || !strings.HasPrefix(connectMessage(err), tc.field+":") || !strings.Contains(err.Error(), tc.limit) {
			t.Errorf("%s: got %v, want invalid_argument %q naming %q", tc.name, err, tc.field, tc.limit)
		}
	}
}

// TestSecurityBadInputUploadLimit: an upload above the limit
// (node.max_upload_mb) is resource_exhausted naming size and the limit,
// whether the header declares it or the data shows it.
func TestSecurityBadInputUploadLimit(t *testing.T) {
	e := setup(t, func(c *apiserver.Config) { c.MaxUploadBytes = 1 << 20 }, "n001")
	id := e.create(busybox()).GetId()
	_, err := e.write(id, "/tmp/big", 2<<30)
	if connect.CodeOf(err) != connect.CodeResourceExhausted || !strings.Contains(err.Error(), "size: 2147483648 bytes exceeds the upload limit of 1048576 bytes (1 MiB, node.max_upload_mb)") {
		t.Errorf("declared 2 GiB: %v, want resource_exhausted naming size and the limit", err)
	}
	chunk := bytes.Repeat([]byte("x"), 512<<10)
	_, err = e.write(id, "/tmp/big", 0, chunk, chunk, chunk)
	if connect.CodeOf(err) != connect.CodeResourceExhausted || !strings.Contains(err.Error(), "over the upload limit of 1048576 bytes") {
		t.Errorf("undeclared 1.5 MiB: %v, want resource_exhausted naming the limit", err)
	}
}

func connectMessage(err error) string {
	if ce := new(connect.Error); errors.As(err, &ce) {
		return ce.Message()
	}
	return ""
}

// FuzzCreateSandbox sends arbitrary bytes as a CreateSandbox body (the
// Connect protocol, application/proto) to the real handler in front of a
// fake node: the answer is never a crash nor internal/unknown — bad input
// is always a categorized error. Seeds: testdata/fuzz/FuzzCreateSandbox
// and the requests below. Longer runs: scripts/fuzz.sh.
func FuzzCreateSandbox(f *testing.F) {
	for _, r := range []*v1.CreateSandboxRequest{
		{Spec: busybox()},
		{Spec: busybox(), RequestId: "retry-1"},
		{Spec: &v1.SandboxSpec{Image: "root/busybox", Cpu: 0.5, MemoryMb: proto.Int64(256), TimeoutSeconds: 60, PidsLimit: 64,
			Env: map[string]string{"A": "b"}, Labels: map[string]string{"team": "rl"}, User: "user", Workdir: "/tmp", TaskId: "t1",
			Network: &v1.NetworkPolicy{RuleSets: []string{"pypi"}, Allow: []*v1.NetworkRule{{Cidr: "10.0.0.0/8", Ports: "443", Protocol: "tcp"}, {Domain: "*.example.com"}}}}},
		{Spec: &v1.SandboxSpec{Image: "root/py:3.11", MemoryMb: proto.Int64(0)}},
		{},
	} {
		b, err := proto.Marshal(r)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	e := setup(f, nil, "n001")
	e.nodes[0].set(func(n *fakeNode) { n.maxSbs = 1 << 30 })
	hc := &http.Client{}
	f.Cleanup(hc.CloseIdleConnections)
	url := e.url + "/" + opendsecv1connect.SandboxServiceName + "/CreateSandbox"
	f.Fuzz(func(t *testing.T, body []byte) {
		req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, url, bytes.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Content-Type", "application/proto")
		req.Header.Set("Authorization", "Bearer "+e.tok)
		resp, err := hc.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode == http.StatusOK {
			return
		}
		var ce struct{ Code, Message string }
		if err := json.Unmarshal(b, &ce); err != nil {
			t.Fatalf("status %d with a body that is not a Connect error: %q", resp.StatusCode, b)
		}
		switch ce.Code {
		case "invalid_argument", "not_found", "resource_exhausted", "permission_denied", "failed_precondition":
		default:
			t.Fatalf("bad input answered %d %s: %s", resp.StatusCode, ce.Code, ce.Message)
		}
	})
}

// TestSecurityBadInputUploadHeaderOnly: a header with no data, which the
// Python SDK sends to learn why an upload was cut off, gets the agent's
// own refusal when the agent refuses the path, and changes nothing.
func TestSecurityBadInputUploadHeaderOnly(t *testing.T) {
	e := setup(t, nil, "n001")
	id := e.create(busybox()).GetId()
	_, err := e.write(id, "/.opendsec/agent", 5<<20)
	if connect.CodeOf(err) != connect.CodePermissionDenied || !strings.Contains(err.Error(), "'/.opendsec/agent'") {
		t.Errorf("header only, reserved path: %v, want permission_denied naming the path", err)
	}
	_, err = e.write(id, "/tmp/f", 5<<20)
	if connect.CodeOf(err) != connect.CodeInvalidArgument || !strings.Contains(err.Error(), "header says 5242880 bytes but 0 arrived") {
		t.Errorf("header only: %v, want invalid_argument on the missing data", err)
	}
	if _, err := e.files.Stat(t.Context(), connect.NewRequest(&v1.StatRequest{SandboxId: id, Path: "/tmp/f"})); connect.CodeOf(err) != connect.CodeNotFound {
		t.Errorf("header-only write left /tmp/f: %v", err)
	}
}
