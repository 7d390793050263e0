package node

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"io"
	"mime/multipart"
	"net/http"
	"net/url"
	"strings"
	"testing"

	"github.com/kernflux/opendsec/internal/trajectory"
)

type writeResult struct {
	status   int
	body     string
	replayed bool
	seq      string
}

// upload POSTs content to the node's /files of sandbox id, as the
// apiserver (plain) or E2B's SDK (multipart) does.
func (f *trajFixture) upload(t *testing.T, id, path, callID, content string, multi bool, hdr ...string) writeResult {
	t.Helper()
	var body io.Reader = strings.NewReader(content)
	ct := "application/octet-stream"
	if multi {
		var b bytes.Buffer
		mw := multipart.NewWriter(&b) // a random boundary every time
		fw, err := mw.CreateFormFile("file", path)
		if err != nil {
			t.Fatal(err)
		}
		io.WriteString(fw, content)
		mw.Close()
		body, ct = &b, mw.FormDataContentType()
	}
	req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, f.srv.URL+AgentPrefix+id+"/files?path="+url.QueryEscape(path), body)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", ct)
	if callID != "" {
		req.Header.Set(CallIDHeader, callID)
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return writeResult{status: resp.StatusCode, body: string(b), replayed: resp.Header.Get(ReplayedHeader) == "true", seq: resp.Header.Get(CallSeqHeader)}
}

func sha(s string) string {
	h := sha256.Sum256([]byte(s))
	return hex.EncodeToString(h[:])
}

// TestTrajectoryLogsFileWrites: uploads through the node's POST /files are
// file_write calls with path, sha256, size and the agent's answer; a
// repeated call ID with the same content is replayed without writing
// (also as multipart with another boundary), with other content refused
// naming both; writes without a call ID always write; a write the agent
// refuses is logged with its answer; FilePathHeader names the logged path.
func TestTrajectoryLogsFileWrites(t *testing.T) {
	f := newTrajFixture(t)
	id := f.create(t)
	ctx := t.Context()

	first := f.upload(t, id, "/work/a.txt", "w1", "hello", false)
	if first.status != http.StatusOK || first.replayed || first.seq != "1" || f.agent.writeCount() != 1 {
		t.Fatalf("first write: %+v, %d writes", first, f.agent.writeCount())
	}
	again := f.upload(t, id, "/work/a.txt", "w1", "hello", false)
	if again.status != http.StatusOK || !again.replayed || again.body != first.body || again.seq != "1" {
		t.Fatalf("repeated write: %+v; want %q replayed", again, first.body)
	}
	if r := f.upload(t, id, "/work/a.txt", "w1", "hello", true); !r.replayed || r.status != http.StatusOK {
		t.Fatalf("the same content as multipart: %+v; want replayed", r)
	}
	if f.agent.writeCount() != 1 {
		t.Fatalf("replayed writes wrote: %d writes", f.agent.writeCount())
	}
	bad := f.upload(t, id, "/work/a.txt", "w1", "other", false)
	if bad.status != http.StatusBadRequest || !strings.Contains(bad.body, "failed_precondition") ||
		!strings.Contains(bad.body, sha("hello")[:12]) || !strings.Contains(bad.body, sha("other")[:12]) {
		t.Fatalf("reused call ID with other content: %+v; want failed_precondition naming both hashes", bad)
	}
	if r := f.upload(t, id, "/work/b.txt", "w1", "hello", false); r.status != http.StatusBadRequest || !strings.Contains(r.body, "/work/b.txt") {
		t.Fatalf("reused call ID for another path: %+v", r)
	}
	if f.agent.writeCount() != 1 || f.agent.files["/work/a.txt"] != "hello" {
		t.Fatalf("after refusals: %d writes, %q", f.agent.writeCount(), f.agent.files["/work/a.txt"])
	}

	// Multipart, no call ID: written each time, logged each time.
	for range 2 {
		if r := f.upload(t, id, "/work/m.txt", "", "multi", true); r.status != http.StatusOK || r.replayed {
			t.Fatalf("multipart write: %+v", r)
		}
	}
	if r := f.upload(t, id, "/forbidden/x", "w2", "nope", false); r.status != http.StatusForbidden {
		t.Fatalf("refused write: %+v", r)
	}
	if r := f.upload(t, id, "/work/.opendsec-upload-1", "", "named", false, FilePathHeader, "/work/target"); r.status != http.StatusOK {
		t.Fatalf("write under another path: %+v", r)
	}
	if r := f.exec(ctx, id, "e1", "", "echo", "between"); r.rpcErr != nil || r.seq != "6" {
		t.Fatalf("an exec after the writes: %+v; want call 6", r)
	}

	_, calls, err := f.n.Trajectory(ctx, id)
	if err != nil || len(calls) != 6 {
		t.Fatalf("log: %d calls, %v", len(calls), err)
	}
	w1 := calls[0]
	if w1.Req.Kind != trajectory.KindFileWrite || w1.Req.Path != "/work/a.txt" || w1.Req.SHA256 != sha("hello") || w1.Req.Size != 5 ||
		w1.HTTPStatus != http.StatusOK || string(w1.Body) != first.body || w1.State != trajectory.StateDone || w1.CallID != "w1" {
		t.Fatalf("logged write %+v", w1)
	}
	if m := calls[1]; m.Req.Path != "/work/m.txt" || m.Req.SHA256 != sha("multi") || m.Req.Size != 5 {
		t.Fatalf("logged multipart write %+v", m.Req)
	}
	if r := calls[3]; r.HTTPStatus != http.StatusForbidden || r.Req.Path != "/forbidden/x" {
		t.Fatalf("logged refused write %+v", r)
	}
	if n := calls[4]; n.Req.Path != "/work/target" || n.Req.SHA256 != sha("named") {
		t.Fatalf("write logged under FilePathHeader: %+v", n.Req)
	}
	if calls[5].Req.Kind != trajectory.KindExec {
		t.Fatalf("call 6: %+v", calls[5].Req)
	}
	// A refused write's call ID replays the refusal.
	if r := f.upload(t, id, "/forbidden/x", "w2", "nope", false); !r.replayed || r.status != http.StatusForbidden {
		t.Fatalf("refused write again: %+v", r)
	}
}
