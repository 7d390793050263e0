package e2b

import (
	"context"
	"net/http"
	"strings"
	"testing"

	"connectrpc.com/connect"

	v1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/internal/errdefs"
)

// fakeImages knows the images in names.
type fakeImages struct{ names map[string]bool }

func (f fakeImages) GetImage(_ context.Context, r *connect.Request[v1.GetImageRequest]) (*connect.Response[v1.GetImageResponse], error) {
	if !f.names[r.Msg.GetName()] {
		// What the store says: it lists every image and operator command.
		return nil, errdefs.ToConnect(errdefs.New(errdefs.ErrNotFound, "image %q not found (available: secret/internal-image); import it with `opendsec image import REF`", r.Msg.GetName()))
	}
	return connect.NewResponse(&v1.GetImageResponse{Image: &v1.Image{Name: r.Msg.GetName()}}), nil
}

func TestTemplateAliases(t *testing.T) {
	h := newHarness(t)
	h.gw.cfg.Images = fakeImages{names: map[string]bool{"root/node:22": true}}
	h.gw.cfg.Templates = map[string]string{"mine": "root/py:3.11"}
	for _, c := range []struct {
		alias  string
		status int
		public bool
	}{
		{DefaultTemplate, 200, true},
		{CodeInterpreterTemplate, 200, true},
		{"mine", 200, true},
		{"root%2Fnode:22", 200, true},
		{"nope", 404, false},
	} {
		w, m := h.do(h.keyA, "GET", "/templates/aliases/"+c.alias, "")
		if w.Code != c.status {
			t.Fatalf("alias %s: %d %s; want %d", c.alias, w.Code, w.Body, c.status)
		}
		if c.status == 200 && (m["public"] != c.public || m["templateID"] == "") {
			t.Fatalf("alias %s: %v", c.alias, m)
		}
		if c.status == 404 && (m["code"] != float64(404) || !strings.Contains(m["message"].(string), "not found")) {
			t.Fatalf("alias %s: E2B's error body wanted, got %v", c.alias, m)
		}
	}
	if w, _ := h.do("", "GET", "/templates/aliases/base", ""); w.Code != http.StatusUnauthorized {
		t.Fatalf("no key: %d", w.Code)
	}
}

// A missing template's 404 tells the caller this gateway's template names,
// not the store's image list or the operator's commands.
func TestTemplateNotFoundHidesTheStore(t *testing.T) {
	h := newHarness(t)
	w, m := h.do(h.keyA, "POST", "/v2/sandboxes", `{"templateID":"nope"}`)
	if w.Code != 404 {
		t.Fatalf("create: %d %s", w.Code, w.Body)
	}
	msg := m["message"].(string)
	if !strings.Contains(msg, `template "nope" not found`) || !strings.Contains(msg, DefaultTemplate) {
		t.Fatalf("message %q", msg)
	}
	for _, leak := range []string{"available", "opendsec image", "`", "root/py"} {
		if strings.Contains(msg, leak) {
			t.Fatalf("message %q leaks %q", msg, leak)
		}
	}
}

// Routes the gateway does not serve yet still answer E2B's 404 for an
// unknown or another team's sandbox, so the SDKs raise not-found errors.
func TestUnservedSandboxRoutesNotFound(t *testing.T) {
	h := newHarness(t) // no snapshot service: the snapshot route is unserved
	w, m := h.do(h.keyA, "POST", "/v2/sandboxes", `{"templateID":"base"}`)
	if w.Code != 201 {
		t.Fatalf("create: %d %s", w.Code, w.Body)
	}
	id := m["sandboxID"].(string)
	for _, route := range []string{"POST /sandboxes/%s/snapshots"} {
		method, path, _ := strings.Cut(route, " ")
		for _, c := range []struct {
			key, id string
			status  int
		}{{h.keyA, "n001aaaaaaaaaaaaaaaa", 404}, {h.keyB, id, 404}, {h.keyA, id, 501}} {
			w, m := h.do(c.key, method, strings.Replace(path, "%s", c.id, 1), "")
			if w.Code != c.status || m["code"] != float64(c.status) {
				t.Fatalf("%s %s: %d %s; want %d", method, path, w.Code, w.Body, c.status)
			}
		}
	}
}
