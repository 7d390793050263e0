package e2b

import (
	"context"
	"fmt"
	"net/http"
	"slices"
	"strings"

	"connectrpc.com/connect"

	v1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/internal/errdefs"
)

// ImageAPI is the part of OpenDsec's image service the gateway uses to
// answer template lookups; opendsecv1connect.ImageServiceClient satisfies it.
type ImageAPI interface {
	GetImage(context.Context, *connect.Request[v1.GetImageRequest]) (*connect.Response[v1.GetImageResponse], error)
}

// templateNames are the E2B template names this gateway maps to images:
// the defaults and the configured ones, sorted.
func (g *Gateway) templateNames() []string {
	names := []string{DefaultTemplate, CodeInterpreterTemplate}
	for n := range g.cfg.Templates {
		if !slices.Contains(names, n) {
			names = append(names, n)
		}
	}
	slices.Sort(names)
	return names
}

// templateNotFound is the 404 of a create from an unknown template. It
// names only what any key holder may know (this gateway's template names,
// and where the caller's own snapshots are listed), never the node's image
// list or an operator's commands.
func (g *Gateway) templateNotFound(w http.ResponseWriter, template string) {
	writeError(w, http.StatusNotFound, "template %q not found; the templates here are %s, any image name the operator has imported, and your snapshots (GET /snapshots)",
		template, strings.Join(g.templateNames(), ", "))
}

// templateAlias is GET /templates/aliases/{alias} → 200 {templateID,
// public}: the alias is a configured template, an image in the store, or
// one of the caller's snapshots; 404 otherwise (the SDKs' Template.exists
// and Mastra's default lookup).
func (g *Gateway) templateAlias(w http.ResponseWriter, r *http.Request) {
	alias := r.PathValue("alias")
	if alias == "" || len(alias) > 256 {
		writeError(w, http.StatusBadRequest, "alias: give a template name of 1 to 256 bytes")
		return
	}
	found, public, err := g.templateExists(r.Context(), alias)
	if err != nil {
		writeErr(w, err)
		return
	}
	if !found {
		writeError(w, http.StatusNotFound, "template alias %q not found", alias)
		return
	}
	id := alias
	if t, _, ok := g.tpls.resolve(principal(r.Context()), alias); ok && !slices.Contains(g.templateNames(), alias) {
		// A built template: E2B answers its ID, which creates, builds
		// and tags take as well as the name.
		id = t.ID
	}
	writeJSON(w, http.StatusOK, map[string]any{"templateID": id, "public": public})
}

// templateExists reports whether template names something a create could
// start: a configured template (public), an image (public: every team of
// this gateway may start it), a template built here (the caller's, or
// another's made public; public as its owner set it) or a snapshot the
// caller owns (private).
func (g *Gateway) templateExists(ctx context.Context, template string) (found, public bool, err error) {
	if slices.Contains(g.templateNames(), template) {
		return true, true, nil
	}
	if t, _, ok := g.tpls.resolveStart(principal(ctx), template); ok {
		g.tpls.mu.Lock()
		defer g.tpls.mu.Unlock()
		return true, t.Public, nil
	}
	if strings.HasPrefix(g.imageFor(template), tplImagePrefix) {
		// Another principal's template image.
		return false, false, nil
	}
	if g.isSnapshotTemplate(template) {
		_, err := g.cfg.Snapshots.GetSnapshot(ctx, connect.NewRequest(&v1.GetSnapshotRequest{Id: template}))
		switch err := errdefs.FromConnect(err); {
		case err == nil:
			return true, false, nil
		case !errdefs.IsNotFound(err) && !errdefs.IsInvalidArgument(err):
			return false, false, fmt.Errorf("get snapshot: %w", err)
		}
	}
	if g.cfg.Images == nil {
		return false, false, nil
	}
	_, err = g.cfg.Images.GetImage(ctx, connect.NewRequest(&v1.GetImageRequest{Name: g.imageFor(template)}))
	switch err := errdefs.FromConnect(err); {
	case err == nil:
		return true, true, nil
	case errdefs.IsNotFound(err) || errdefs.IsInvalidArgument(err):
		return false, false, nil
	default:
		return false, false, fmt.Errorf("get image: %w", err)
	}
}

// notYet answers a sandbox route the gateway does not serve yet: E2B's
// 404 for an unknown or killed sandbox (so the SDKs raise their not-found
// errors), else 501.
func (g *Gateway) notYet(w http.ResponseWriter, r *http.Request) {
	if _, err := g.lookup(r.Context(), sandboxID(r)); err != nil {
		writeErr(w, err)
		return
	}
	writeError(w, http.StatusNotImplemented, "%s %s is not supported by OpenDsec's E2B gateway yet (see docs/E2B.md)", r.Method, r.URL.Path)
}
