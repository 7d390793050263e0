package e2b

import (
	"bytes"
	"cmp"
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/sync/errgroup"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	v1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/internal/auth"
	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/log"
	"github.com/kernflux/opendsec/internal/sandboxspec"
)

// maxBody caps a control-plane request body.
const maxBody = 1 << 20

type principalKey struct{}

// sandboxJSON is E2B's Sandbox (create and connect responses).
type sandboxJSON struct {
	SandboxID          string  `json:"sandboxID"`
	TemplateID         string  `json:"templateID"`
	ClientID           string  `json:"clientID"`
	EnvdVersion        string  `json:"envdVersion"`
	EnvdAccessToken    string  `json:"envdAccessToken,omitempty"`
	TrafficAccessToken *string `json:"trafficAccessToken"`
	Domain             *string `json:"domain"`
	Alias              string  `json:"alias,omitempty"`
}

// lifecycleJSON is E2B's SandboxLifecycle.
type lifecycleJSON struct {
	OnTimeout  string `json:"onTimeout"`
	AutoResume bool   `json:"autoResume"`
}

// detailJSON is E2B's SandboxDetail (GET /sandboxes/{id}) and, without the
// detail-only fields, ListedSandbox.
type detailJSON struct {
	TemplateID          string            `json:"templateID"`
	SandboxID           string            `json:"sandboxID"`
	ClientID            string            `json:"clientID"`
	Alias               string            `json:"alias,omitempty"`
	StartedAt           time.Time         `json:"startedAt"`
	EndAt               time.Time         `json:"endAt"`
	EnvdVersion         string            `json:"envdVersion"`
	CPUCount            int               `json:"cpuCount"`
	MemoryMB            int64             `json:"memoryMB"`
	DiskSizeMB          int64             `json:"diskSizeMB"`
	State               string            `json:"state"`
	Metadata            map[string]string `json:"metadata"`
	VolumeMounts        []any             `json:"volumeMounts"`
	EnvdAccessToken     string            `json:"envdAccessToken,omitempty"`
	AllowInternetAccess *bool             `json:"allowInternetAccess,omitempty"`
	Domain              *string           `json:"domain,omitempty"`
	Network             *networkInfoJSON  `json:"network,omitempty"`
	Lifecycle           *lifecycleJSON    `json:"lifecycle,omitempty"`
}

// networkInfoJSON is the part of E2B's SandboxNetworkConfig a detail
// reports back.
type networkInfoJSON struct {
	MaskRequestHost string `json:"maskRequestHost,omitempty"`
}

// newSandboxJSON is NewSandbox (v1) and NewSandboxV2.
type newSandboxJSON struct {
	TemplateID      string            `json:"templateID"`
	Timeout         *int64            `json:"timeout"`
	AutoPause       *bool             `json:"autoPause"`
	AutoPauseMemory *bool             `json:"autoPauseMemory"`
	Secure          *bool             `json:"secure"`
	Metadata        map[string]string `json:"metadata"`
	EnvVars         map[string]string `json:"envVars"`
	AutoResume      *struct {
		Enabled bool `json:"enabled"`
	} `json:"autoResume"`
	VolumeMounts        []json.RawMessage `json:"volumeMounts"`
	MCP                 json.RawMessage   `json:"mcp"`
	AllowInternetAccess *bool             `json:"allow_internet_access"`
	Network             *networkJSON      `json:"network"`
}

func (g *Gateway) apiMux() http.Handler {
	mux := http.NewServeMux()
	h := func(pattern string, f http.HandlerFunc) { mux.Handle(pattern, g.authenticated(f)) }
	h("POST /sandboxes", g.create(false))
	h("POST /v2/sandboxes", g.create(true))
	h("GET /sandboxes", g.list(true))
	h("GET /v2/sandboxes", g.list(false))
	h("GET /sandboxes/{id}", g.get)
	h("DELETE /sandboxes/{id}", g.kill)
	h("POST /sandboxes/{id}/timeout", g.setTimeout)
	h("POST /sandboxes/{id}/refreshes", g.refresh)
	h("POST /sandboxes/{id}/connect", g.connect(15))
	h("POST /v2/sandboxes/{id}/connect", g.connect(300))
	h("POST /sandboxes/{id}/pause", g.pause)
	h("POST /sandboxes/{id}/resume", g.resume)
	h("GET /sandboxes/{id}/metrics", g.metrics)
	h("GET /sandboxes/metrics", g.metricsMany)
	h("PUT /sandboxes/{id}/network", g.updateNetwork)
	h("POST /sandboxes/{id}/fork", g.fork)
	if g.cfg.Builder != nil {
		// E2B's template builds (tplbuild.go).
		h("POST /v3/templates", g.requestTemplateBuild)
		h("GET /templates/{id}/files/{hash}", g.templateFile)
		// The signed upload URL: no API key, like E2B's storage URLs.
		mux.HandleFunc("PUT /templates/{id}/files/{hash}", g.uploadTemplateFile)
		h("POST /v2/templates/{id}/builds/{buildID}", g.startTemplateBuild)
		h("GET /templates/{id}/builds/{buildID}/status", g.templateBuildStatus)
		h("POST /templates/tags", g.assignTemplateTags)
		h("DELETE /templates/tags", g.deleteTemplateTags)
		h("GET /templates", g.listTemplates)
		h("GET /v2/templates", g.listTemplatesV2)
		h("GET /templates/{id}", g.getTemplate)
		h("PATCH /templates/{id}", g.patchTemplate(false))
		h("PATCH /v2/templates/{id}", g.patchTemplate(true))
		h("GET /templates/{id}/builds/{buildID}/logs", g.templateBuildLogs)
		// aliases/{alias} and {templateID}/tags.
		h("GET /templates/{id}/{sub}", g.templateSubroute)
		h("DELETE /templates/{id}", g.deleteBuiltTemplate)
	} else {
		h("GET /templates/aliases/{alias}", g.templateAlias)
	}
	h("GET /sandboxes/{id}/logs", g.sandboxLogs(false))
	h("GET /v2/sandboxes/{id}/logs", g.sandboxLogs(true))
	h("GET /teams", g.teams)
	unsupported := []string{"/templates/", "/v2/templates/", "/v3/templates"}
	if g.cfg.Snapshots != nil {
		h("POST /sandboxes/{id}/snapshots", g.createSnapshot)
		h("GET /snapshots", g.listSnapshots)
		if g.cfg.Builder == nil {
			h("DELETE /templates/{id}", g.deleteTemplate)
		}
	} else {
		h("POST /sandboxes/{id}/snapshots", g.notYet)
		unsupported = append(unsupported, "GET /snapshots")
	}
	for _, p := range unsupported {
		h(p, func(w http.ResponseWriter, r *http.Request) {
			writeError(w, http.StatusNotImplemented, "%s %s is not supported by OpenDsec's E2B gateway yet (see docs/E2B.md)", r.Method, r.URL.Path)
		})
	}
	// Secrets and volumes (E2B's §2.16) are not served: the 501 says what
	// to use instead.
	for _, p := range []string{"/secrets", "/secrets/"} {
		h(p, func(w http.ResponseWriter, r *http.Request) {
			writeError(w, http.StatusNotImplemented, "%s %s: OpenDsec's E2B gateway keeps no secrets; pass values to a sandbox as envVars on create (the SDKs' envs=) or per command, from your own secret store (see docs/E2B.md#secrets-and-volumes)", r.Method, r.URL.Path)
		})
	}
	for _, p := range []string{"/volumes", "/volumes/"} {
		h(p, func(w http.ResponseWriter, r *http.Request) {
			writeError(w, http.StatusNotImplemented, "%s %s: OpenDsec's E2B gateway has no volumes; keep a sandbox's files with a snapshot (Sandbox.create_snapshot(), then create from its ID) or copy them with the files API (see docs/E2B.md#secrets-and-volumes)", r.Method, r.URL.Path)
		})
	}
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusOK) })
	mux.Handle("GET /metrics", g.prom.handler()) // no key, like /health
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeError(w, http.StatusNotFound, "%s %s: no such route", r.Method, r.URL.Path)
	})
	return mux
}

// authenticated checks X-API-Key and puts the key's principal in the
// request context, with a user-scope token for that principal that the
// gateway's calls to the API carry (auth.WithBearer): the API and the node
// see the principal, not the gateway.
func (g *Gateway) authenticated(next http.HandlerFunc) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p, err := g.cfg.Keys.Lookup(strings.TrimSpace(r.Header.Get("X-API-Key")))
		if err != nil {
			if errors.Is(err, errdefs.ErrUnauthenticated) {
				writeError(w, http.StatusUnauthorized, "%s", err.Error())
				return
			}
			log.G(r.Context()).Error("look up api key", log.Err(err))
			writeError(w, http.StatusInternalServerError, "cannot check the API key: %s", err.Error())
			return
		}
		tok, err := g.principalToken(p)
		if err != nil {
			log.G(r.Context()).Error("mint principal token", "principal", p, log.Err(err))
			writeError(w, http.StatusInternalServerError, "cannot act for principal %s: %s", p, err.Error())
			return
		}
		ctx := auth.WithBearer(context.WithValue(r.Context(), principalKey{}, p), tok)
		next(w, r.WithContext(ctx))
	})
}

func principal(ctx context.Context) string {
	p, _ := ctx.Value(principalKey{}).(string)
	return p
}

// decode reads a JSON body into v; an empty body leaves v as is.
func decode(r *http.Request, v any) error {
	b, err := io.ReadAll(io.LimitReader(r.Body, maxBody+1))
	if err != nil {
		return errdefs.New(errdefs.ErrInvalidArgument, "read request body: %s", err)
	}
	if len(b) > maxBody {
		return errdefs.New(errdefs.ErrInvalidArgument, "request body is larger than %d bytes", maxBody)
	}
	if len(bytes.TrimSpace(b)) == 0 {
		return nil
	}
	if err := json.Unmarshal(b, v); err != nil {
		return errdefs.New(errdefs.ErrInvalidArgument, "request body is not valid JSON for this route: %s", err)
	}
	return nil
}

func requestID() string {
	b := make([]byte, 16)
	_, _ = rand.Read(b)
	return "e2b-" + hex.EncodeToString(b)
}

func (g *Gateway) imageFor(template string) string {
	if img, ok := g.cfg.Templates[template]; ok {
		return img
	}
	switch template {
	case DefaultTemplate:
		return DefaultImage
	case CodeInterpreterTemplate:
		return CodeInterpreterImage
	}
	return template
}

func checkTimeout(field string, t int64) error {
	switch {
	case t <= 0:
		return errdefs.Invalid(field, "Timeout must be greater than 0")
	case t > MaxTimeoutSeconds:
		return errdefs.Invalid(field, "Timeout cannot be greater than %d hours", MaxTimeoutSeconds/3600)
	}
	return nil
}

func (g *Gateway) create(v2 bool) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		var req newSandboxJSON
		if err := decode(r, &req); err != nil {
			writeErr(w, err)
			return
		}
		if strings.TrimSpace(req.TemplateID) == "" {
			writeError(w, http.StatusBadRequest, "templateID: is empty; give a template, e.g. %q", DefaultTemplate)
			return
		}
		timeout := int64(15)
		if v2 {
			timeout = 300
		}
		if req.Timeout != nil {
			timeout = *req.Timeout
		}
		if err := checkTimeout("timeout", timeout); err != nil {
			writeErr(w, err)
			return
		}
		if len(req.VolumeMounts) > 0 {
			writeError(w, http.StatusBadRequest, "volumeMounts: volumes are not supported by OpenDsec's E2B gateway yet")
			return
		}
		if len(req.MCP) > 0 && string(req.MCP) != "null" {
			writeError(w, http.StatusBadRequest, "mcp: the MCP gateway is not supported by OpenDsec's E2B gateway yet")
			return
		}
		autoPause := req.AutoPause != nil && *req.AutoPause
		// autoPauseMemory false: the timeout's pause keeps only the files
		// (the node's on_timeout "pause_filesystem"), as E2B's.
		fsPause := req.AutoPauseMemory != nil && !*req.AutoPauseMemory
		if fsPause {
			if !autoPause {
				writeError(w, http.StatusBadRequest, "autoPauseMemory: only meaningful with autoPause: true")
				return
			}
			if req.AutoResume != nil && req.AutoResume.Enabled {
				writeError(w, http.StatusBadRequest, "autoResume: a filesystem-only pause (autoPauseMemory: false) cannot be resumed by traffic; set autoResume false or drop autoPauseMemory")
				return
			}
		}
		secure := v2 || req.Secure == nil || *req.Secure
		labels := map[string]string{
			labelTeam:     principal(r.Context()),
			labelTemplate: req.TemplateID,
		}
		// autoResume: traffic to a paused sandbox resumes it (the node's
		// auto-resume) unless the create said {"enabled": false}.
		if req.AutoResume != nil && !req.AutoResume.Enabled {
			labels[labelNoResume] = "true"
		}
		if req.Network != nil && req.Network.MaskRequestHost != nil && *req.Network.MaskRequestHost != "" {
			if err := checkMask("network.maskRequestHost", *req.Network.MaskRequestHost); err != nil {
				writeErr(w, err)
				return
			}
			labels[labelMask] = *req.Network.MaskRequestHost
		}
		if len(req.TemplateID) > 256 {
			writeError(w, http.StatusBadRequest, "templateID: is longer than 256 bytes")
			return
		}
		if secure {
			labels[labelSecure] = "true"
		}
		if err := metadataLabels(req.Metadata, labels); err != nil {
			writeErr(w, err)
			return
		}
		// Named as the caller sent it (the API would say "env").
		if err := sandboxspec.CheckEnv("envVars", req.EnvVars); err != nil {
			writeErr(w, err)
			return
		}
		network, err := createNetwork(req.AllowInternetAccess, req.Network, !g.cfg.DenyInternetByDefault)
		if err != nil {
			writeErr(w, err)
			return
		}
		if req.Network != nil && req.Network.AllowPublicTraffic != nil && !*req.Network.AllowPublicTraffic {
			if !secure {
				writeError(w, http.StatusBadRequest, "network.allowPublicTraffic: false needs a secure sandbox; drop secure=false")
				return
			}
			labels[labelPrivate] = "true"
		}
		spec := &v1.SandboxSpec{
			Backend:        g.cfg.Backend,
			Image:          g.imageFor(req.TemplateID),
			TimeoutSeconds: timeout,
			Env:            req.EnvVars,
			Labels:         labels,
			User:           g.cfg.User,
			Workdir:        homeOf(g.cfg.User),
			Network:        network,
			OnTimeout:      onTimeout(autoPause, fsPause),
			// E2B's sandboxes let user sudo; ours keep the capability set
			// and seccomp filter either way.
			AllowPrivilegeEscalation: !g.cfg.NoPrivilegeEscalation,
		}
		var startCmd, readyCmd string
		if t, tb, ok := g.tpls.resolveStart(principal(r.Context()), req.TemplateID); ok {
			// A template built through this gateway (the caller's, or a
			// public one by its ID): its image, and the
			// user and workdir its steps ended with.
			spec.Image = tb.Image
			// E2B reports a template's ID as templateID and its name as
			// alias however the create named it (name, name:tag or ID).
			labels[labelTemplate], labels[labelAlias] = t.ID, t.Name
			spec.User = cmp.Or(tb.User, spec.User)
			spec.Workdir = cmp.Or(tb.Workdir, spec.Workdir)
			startCmd, readyCmd = tb.StartCmd, tb.ReadyCmd
			// The build's cpuCount and memoryMB, as E2B gives its
			// template's sandboxes.
			if tb.CPU > 0 {
				spec.Cpu = float64(tb.CPU)
			}
			if tb.MemMB > 0 {
				spec.MemoryMb = proto.Int64(int64(tb.MemMB))
			}
			g.tpls.spawned(t.ID)
		} else if t != nil || strings.HasPrefix(spec.Image, tplImagePrefix) {
			// The caller's (or a public) template with no finished build
			// of that tag, or another principal's template image.
			g.templateNotFound(w, req.TemplateID)
			return
		} else if g.isSnapshotTemplate(req.TemplateID) {
			// A snapshot: its source's image, user, workdir and env are
			// the defaults (the API resolves them).
			spec.Image, spec.Snapshot, spec.User, spec.Workdir = "", req.TemplateID, "", ""
			spec.Backend = "" // its source's
		}
		resp, err := g.cfg.API.CreateSandbox(r.Context(), connect.NewRequest(&v1.CreateSandboxRequest{Spec: spec, RequestId: requestID()}))
		if err != nil && implicitNetwork(req) && errdefs.IsNetworkOff(errdefs.FromConnect(err)) {
			// E2B's default internet on a node whose network policy is
			// off (its sandboxes have no network): the default cannot be
			// had there, and the caller asked for nothing, so create
			// without it. The node refused at admission: nothing was made.
			spec.Network = nil
			resp, err = g.cfg.API.CreateSandbox(r.Context(), connect.NewRequest(&v1.CreateSandboxRequest{Spec: spec, RequestId: requestID()}))
		}
		if err != nil {
			err = errdefs.FromConnect(err)
			if spec.Snapshot != "" && (errdefs.IsNotFound(err) || errdefs.IsInvalidArgument(err) && strings.HasPrefix(err.Error(), "snapshot")) ||
				errdefs.IsNotFound(err) || (errdefs.IsInvalidArgument(err) && strings.HasPrefix(err.Error(), "image")) {
				// The API's text may list the store's images and the
				// operator's commands: not for every key holder.
				log.G(r.Context()).Debug("e2b create: template not found", "template", req.TemplateID, log.Err(err))
				g.templateNotFound(w, req.TemplateID)
				return
			}
			if fsPause {
				err = g.fsPauseHint(err)
			}
			writeErr(w, fmt.Errorf("create sandbox: %w", err))
			return
		}
		sb := resp.Msg.GetSandbox()
		if startCmd != "" {
			if err := g.startTemplateCmd(r.Context(), sb.GetId(), spec.GetUser(), spec.GetWorkdir(), startCmd, readyCmd); err != nil {
				// Not the sandbox the template promises: none.
				if _, serr := g.cfg.API.StopSandbox(context.WithoutCancel(r.Context()), connect.NewRequest(&v1.StopSandboxRequest{Id: sb.GetId()})); serr != nil {
					log.G(r.Context()).Warn("e2b create: stop a sandbox whose start command failed", log.SandboxID(sb.GetId()), log.Err(serr))
				}
				writeErr(w, err)
				return
			}
		}
		writeJSON(w, http.StatusCreated, g.sandboxOf(sb))
	}
}

// implicitNetwork reports whether a create named no network option (its
// policy is the gateway's default).
func implicitNetwork(req newSandboxJSON) bool {
	return req.AllowInternetAccess == nil && (req.Network == nil || (req.Network.AllowOut == nil && req.Network.DenyOut == nil))
}

func homeOf(user string) string {
	if user == "root" {
		return "/root"
	}
	return "/home/" + user
}

func (g *Gateway) sandboxOf(sb *v1.Sandbox) sandboxJSON {
	l := sb.GetSpec().GetLabels()
	d := g.cfg.Domain
	out := sandboxJSON{
		SandboxID:   sb.GetId(),
		TemplateID:  l[labelTemplate],
		ClientID:    ClientID,
		EnvdVersion: EnvdVersion,
		Domain:      &d,
		Alias:       cmp.Or(l[labelAlias], l[labelTemplate]),
	}
	if l[labelSecure] == "true" {
		out.EnvdAccessToken = g.accessToken(sb.GetId())
	}
	if l[labelPrivate] == "true" {
		t := g.trafficToken(sb.GetId())
		out.TrafficAccessToken = &t
	}
	return out
}

func stateOf(sb *v1.Sandbox) string {
	switch sb.GetState() {
	case v1.SandboxState_SANDBOX_STATE_RUNNING:
		return "running"
	case v1.SandboxState_SANDBOX_STATE_PAUSED:
		return "paused"
	}
	return ""
}

func (g *Gateway) detailOf(sb *v1.Sandbox, full bool) detailJSON {
	l := sb.GetSpec().GetLabels()
	out := detailJSON{
		TemplateID:   l[labelTemplate],
		SandboxID:    sb.GetId(),
		ClientID:     ClientID,
		Alias:        cmp.Or(l[labelAlias], l[labelTemplate]),
		StartedAt:    sb.GetCreatedAt().AsTime().UTC(),
		EndAt:        sb.GetExpiresAt().AsTime().UTC(),
		EnvdVersion:  EnvdVersion,
		CPUCount:     max(1, int(math.Ceil(sb.GetSpec().GetCpu()))),
		MemoryMB:     sb.GetSpec().GetMemoryMb(),
		DiskSizeMB:   sb.GetSpec().GetDiskMb(),
		State:        stateOf(sb),
		Metadata:     metadataOf(l),
		VolumeMounts: []any{},
	}
	if full {
		d := g.cfg.Domain
		out.Domain = &d
		out.AllowInternetAccess = internetAllowed(sb.GetSpec().GetNetwork())
		if m := l[labelMask]; m != "" {
			out.Network = &networkInfoJSON{MaskRequestHost: m}
		}
		// Traffic to a paused sandbox resumes it (the node's auto-resume)
		// unless the create asked for autoResume {"enabled": false}.
		out.Lifecycle = &lifecycleJSON{OnTimeout: "kill", AutoResume: l[labelNoResume] != "true"}
		if sp := sb.GetSpec(); sp.GetOnTimeout() == sandboxspec.OnTimeoutPause || sp.GetOnTimeout() == sandboxspec.OnTimeoutPauseFilesystem || sp.GetAutoPause() {
			out.Lifecycle.OnTimeout = "pause"
		}
		if l[labelSecure] == "true" {
			out.EnvdAccessToken = g.accessToken(sb.GetId())
		}
	}
	return out
}

// lookup returns the caller's live sandbox id, or a not-found error (also
// for sandboxes of other principals and stopped ones).
func (g *Gateway) lookup(ctx context.Context, id string) (*v1.Sandbox, error) {
	notFound := errdefs.New(errdefs.ErrNotFound, "sandbox %q not found", id)
	resp, err := g.cfg.API.GetSandbox(ctx, connect.NewRequest(&v1.GetSandboxRequest{Id: id}))
	if err != nil {
		err = errdefs.FromConnect(err)
		if errdefs.IsNotFound(err) || errdefs.IsInvalidArgument(err) {
			return nil, notFound
		}
		return nil, fmt.Errorf("get sandbox: %w", err)
	}
	sb := resp.Msg.GetSandbox()
	if sb.GetSpec().GetLabels()[labelTeam] != principal(ctx) || stateOf(sb) == "" {
		return nil, notFound
	}
	return sb, nil
}

// sandboxID is the path's sandbox ID; E2B tolerates "<id>-<clientID>".
func sandboxID(r *http.Request) string {
	id := r.PathValue("id")
	if i := strings.IndexByte(id, '-'); i >= 0 {
		id = id[:i]
	}
	return id
}

func (g *Gateway) get(w http.ResponseWriter, r *http.Request) {
	sb, err := g.lookup(r.Context(), sandboxID(r))
	if err != nil {
		writeErr(w, err)
		return
	}
	writeJSON(w, http.StatusOK, g.detailOf(sb, true))
}

func (g *Gateway) kill(w http.ResponseWriter, r *http.Request) {
	id := sandboxID(r)
	if _, err := g.lookup(r.Context(), id); err != nil {
		writeErr(w, err)
		return
	}
	if _, err := g.cfg.API.StopSandbox(r.Context(), connect.NewRequest(&v1.StopSandboxRequest{Id: id})); err != nil {
		writeErr(w, fmt.Errorf("stop sandbox: %w", errdefs.FromConnect(err)))
		return
	}
	g.forget(id)
	w.WriteHeader(http.StatusNoContent)
}

// setTTL sets the sandbox's lifetime to end secs from now; extendOnly keeps
// a later end.
func (g *Gateway) setTTL(ctx context.Context, sb *v1.Sandbox, secs int64, extendOnly bool) (*v1.Sandbox, error) {
	if extendOnly && sb.GetExpiresAt().AsTime().After(time.Now().Add(time.Duration(secs)*time.Second)) {
		return sb, nil
	}
	resp, err := g.cfg.API.SetTimeout(ctx, connect.NewRequest(&v1.SetTimeoutRequest{Id: sb.GetId(), TimeoutSeconds: max(secs, 1)}))
	if err != nil {
		return nil, fmt.Errorf("set timeout: %w", errdefs.FromConnect(err))
	}
	if s := resp.Msg.GetSandbox(); s != nil {
		return s, nil
	}
	return sb, nil
}

func (g *Gateway) setTimeout(w http.ResponseWriter, r *http.Request) {
	var body struct {
		Timeout *int64 `json:"timeout"`
	}
	if err := decode(r, &body); err != nil {
		writeErr(w, err)
		return
	}
	if body.Timeout == nil || *body.Timeout < 0 || *body.Timeout > MaxTimeoutSeconds {
		writeError(w, http.StatusBadRequest, "timeout: give seconds between 0 and %d, e.g. {\"timeout\": 300}", MaxTimeoutSeconds)
		return
	}
	sb, err := g.lookup(r.Context(), sandboxID(r))
	if err != nil {
		writeErr(w, err)
		return
	}
	if _, err := g.setTTL(r.Context(), sb, *body.Timeout, false); err != nil {
		writeErr(w, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

func (g *Gateway) refresh(w http.ResponseWriter, r *http.Request) {
	var body struct {
		Duration *int64 `json:"duration"`
	}
	if err := decode(r, &body); err != nil {
		writeErr(w, err)
		return
	}
	d := int64(0)
	if body.Duration != nil {
		d = *body.Duration
	}
	if d < 0 || d > 3600 {
		writeError(w, http.StatusBadRequest, "duration: %d must be between 0 and 3600 seconds", d)
		return
	}
	sb, err := g.lookup(r.Context(), sandboxID(r))
	if err != nil {
		writeErr(w, err)
		return
	}
	if d > 0 {
		if _, err := g.setTTL(r.Context(), sb, d, true); err != nil {
			writeErr(w, err)
			return
		}
	}
	w.WriteHeader(http.StatusNoContent)
}

// connect extends a running sandbox's lifetime (never shortens it) and
// returns it with 200, or resumes a paused one (lifetime: timeout from now)
// and returns it with 201.
func (g *Gateway) connect(defTimeout int64) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		var body struct {
			Timeout *int64 `json:"timeout"`
			Memory  *bool  `json:"memory"`
		}
		if err := decode(r, &body); err != nil {
			writeErr(w, err)
			return
		}
		t := defTimeout
		if body.Timeout != nil {
			t = *body.Timeout
		}
		if t < 0 || t > MaxTimeoutSeconds {
			writeError(w, http.StatusBadRequest, "timeout: %d must be between 0 and %d seconds", t, MaxTimeoutSeconds)
			return
		}
		sb, err := g.lookup(r.Context(), sandboxID(r))
		if err != nil {
			writeErr(w, err)
			return
		}
		if stateOf(sb) == "paused" {
			reboot := body.Memory != nil && !*body.Memory
			sb, err := g.resumePaused(r.Context(), sb, t, reboot)
			if err != nil {
				writeErr(w, err)
				return
			}
			writeJSON(w, http.StatusCreated, g.sandboxOf(sb))
			return
		}
		if t > 0 {
			if sb, err = g.setTTL(r.Context(), sb, t, true); err != nil {
				writeErr(w, err)
				return
			}
		}
		writeJSON(w, http.StatusOK, g.sandboxOf(sb))
	}
}

// pause freezes the sandbox: 204, or 409 when it already is paused.
func (g *Gateway) pause(w http.ResponseWriter, r *http.Request) {
	var body struct {
		Memory *bool `json:"memory"`
	}
	if err := decode(r, &body); err != nil {
		writeErr(w, err)
		return
	}
	sb, err := g.lookup(r.Context(), sandboxID(r))
	if err != nil {
		writeErr(w, err)
		return
	}
	if stateOf(sb) == "paused" {
		writeError(w, http.StatusConflict, "sandbox %s is already paused", sb.GetId())
		return
	}
	g.forget(sb.GetId())
	// memory false: keep only the files (resume starts it again on them).
	fsOnly := body.Memory != nil && !*body.Memory
	if _, err := g.cfg.API.PauseSandbox(r.Context(), connect.NewRequest(&v1.PauseSandboxRequest{Id: sb.GetId(), FilesystemOnly: fsOnly})); err != nil {
		err = errdefs.FromConnect(err)
		if fsOnly {
			err = g.fsPauseHint(err)
		}
		writeErr(w, fmt.Errorf("pause sandbox: %w", err))
		return
	}
	g.forget(sb.GetId())
	w.WriteHeader(http.StatusNoContent)
}

// fsPauseHint adds to a backend's refusal of a filesystem-only pause
// (E2B's memory: false, autoPauseMemory: false) what fixes it: E2B clients
// cannot pick a backend, the gateway's operator can (e2b.backend).
func (g *Gateway) fsPauseHint(err error) error {
	if !errors.Is(err, errdefs.ErrUnimplemented) && !errdefs.IsInvalidArgument(err) ||
		!strings.Contains(err.Error(), "keeping only its files") {
		return err
	}
	have := "the node's default backend"
	if g.cfg.Backend != "" {
		have = fmt.Sprintf("backend %q", g.cfg.Backend)
	}
	return errdefs.WithPublic(err, "%s (E2B sandboxes run on %s, which the gateway's operator sets: e2b.backend: container in OpenDsec's config makes memory: false work)", errdefs.PublicMessage(err), have)
}

// resumePaused resumes a paused sandbox; with reboot (E2B's memory false
// on connect or resume) one paused with its memory drops it first, so it
// starts again from its files.
func (g *Gateway) resumePaused(ctx context.Context, sb *v1.Sandbox, timeout int64, reboot bool) (*v1.Sandbox, error) {
	if reboot && !sb.GetPausedFilesystem() {
		g.forget(sb.GetId())
		if _, err := g.cfg.API.PauseSandbox(ctx, connect.NewRequest(&v1.PauseSandboxRequest{Id: sb.GetId(), FilesystemOnly: true})); err != nil {
			return nil, fmt.Errorf("drop the memory of paused sandbox %s for a reboot: %w", sb.GetId(), g.fsPauseHint(errdefs.FromConnect(err)))
		}
	}
	return g.resumeSandbox(ctx, sb.GetId(), timeout)
}

// resumeSandbox thaws a paused sandbox; its lifetime ends timeout seconds
// from now (E2B restarts the clock on resume).
func (g *Gateway) resumeSandbox(ctx context.Context, id string, timeout int64) (*v1.Sandbox, error) {
	resp, err := g.cfg.API.ResumeSandbox(ctx, connect.NewRequest(&v1.ResumeSandboxRequest{Id: id, TimeoutSeconds: max(timeout, 1)}))
	if err != nil {
		return nil, fmt.Errorf("resume sandbox: %w", errdefs.FromConnect(err))
	}
	g.forget(id)
	return resp.Msg.GetSandbox(), nil
}

// resume is the deprecated POST /sandboxes/{id}/resume: 201 with the
// sandbox, or 409 when it is running.
func (g *Gateway) resume(w http.ResponseWriter, r *http.Request) {
	var body struct {
		Timeout   *int64 `json:"timeout"`
		AutoPause *bool  `json:"autoPause"`
		Memory    *bool  `json:"memory"`
	}
	if err := decode(r, &body); err != nil {
		writeErr(w, err)
		return
	}
	t := int64(15)
	if body.Timeout != nil {
		t = *body.Timeout
	}
	if err := checkTimeout("timeout", t); err != nil {
		writeErr(w, err)
		return
	}
	sb, err := g.lookup(r.Context(), sandboxID(r))
	if err != nil {
		writeErr(w, err)
		return
	}
	if stateOf(sb) == "running" {
		writeError(w, http.StatusConflict, "sandbox %s is already running", sb.GetId())
		return
	}
	if sb, err = g.resumePaused(r.Context(), sb, t, body.Memory != nil && !*body.Memory); err != nil {
		writeErr(w, err)
		return
	}
	writeJSON(w, http.StatusCreated, g.sandboxOf(sb))
}

// metricJSON is E2B's SandboxMetric.
type metricJSON struct {
	Timestamp     time.Time `json:"timestamp"`
	TimestampUnix int64     `json:"timestampUnix"`
	CPUCount      int32     `json:"cpuCount"`
	CPUUsedPct    float64   `json:"cpuUsedPct"`
	MemUsed       int64     `json:"memUsed"`
	MemTotal      int64     `json:"memTotal"`
	MemCache      int64     `json:"memCache"`
	DiskUsed      int64     `json:"diskUsed"`
	DiskTotal     int64     `json:"diskTotal"`
}

func metricOf(m *v1.SandboxMetrics) metricJSON {
	ts := m.GetTimestamp().AsTime().UTC()
	return metricJSON{
		Timestamp:     ts,
		TimestampUnix: ts.Unix(),
		CPUCount:      int32(max(1, math.Ceil(m.GetCpuCount()))),
		CPUUsedPct:    math.Round(m.GetCpuUsedPct()*100) / 100,
		MemUsed:       m.GetMemUsedBytes(),
		MemTotal:      m.GetMemTotalBytes(),
		MemCache:      m.GetMemCacheBytes(),
		DiskUsed:      m.GetDiskUsedBytes(),
		DiskTotal:     m.GetDiskTotalBytes(),
	}
}

// metrics answers GET /sandboxes/{id}/metrics?start=&end= (unix seconds).
// OpenDsec keeps no metrics history: the answer is the current sample when
// "now" is within the window (E2B's 10 s tolerance included), else [].
func (g *Gateway) metrics(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	var bounds [2]*time.Time
	for i, name := range []string{"start", "end"} {
		if v := q.Get(name); v != "" {
			n, err := strconv.ParseInt(v, 10, 64)
			if err != nil || n < 0 {
				writeError(w, http.StatusBadRequest, "%s: %q is not a unix time in seconds", name, v)
				return
			}
			t := time.Unix(n, 0)
			bounds[i] = &t
		}
	}
	if bounds[0] != nil && bounds[1] != nil && bounds[1].Before(*bounds[0]) {
		writeError(w, http.StatusBadRequest, "end: is before start")
		return
	}
	sb, err := g.lookup(r.Context(), sandboxID(r))
	if err != nil {
		writeErr(w, err)
		return
	}
	now := time.Now()
	const slack = 10 * time.Second
	if (bounds[0] != nil && now.Before(bounds[0].Add(-slack))) || (bounds[1] != nil && now.After(bounds[1].Add(slack))) {
		writeJSON(w, http.StatusOK, []metricJSON{})
		return
	}
	resp, err := g.cfg.API.GetSandboxMetrics(r.Context(), connect.NewRequest(&v1.GetSandboxMetricsRequest{Id: sb.GetId()}))
	if err != nil {
		writeErr(w, fmt.Errorf("get sandbox metrics: %w", errdefs.FromConnect(err)))
		return
	}
	writeJSON(w, http.StatusOK, []metricJSON{metricOf(resp.Msg.GetMetrics())})
}

// metricsMany answers GET /sandboxes/metrics?sandbox_ids=a,b (at most 100)
// with the current sample of each of the caller's sandboxes; unknown ones
// are left out. Sandboxes are asked maxMetricsCalls at a time.
func (g *Gateway) metricsMany(w http.ResponseWriter, r *http.Request) {
	var ids []string
	for _, v := range r.URL.Query()["sandbox_ids"] {
		for _, id := range strings.Split(v, ",") {
			if i := strings.IndexByte(id, '-'); i >= 0 {
				id = id[:i]
			}
			if id = strings.TrimSpace(id); id != "" && !slices.Contains(ids, id) {
				ids = append(ids, id)
			}
		}
	}
	if len(ids) == 0 || len(ids) > 100 {
		writeError(w, http.StatusBadRequest, "sandbox_ids: give 1 to 100 comma-separated sandbox IDs, got %d", len(ids))
		return
	}
	var mu sync.Mutex
	out := map[string]metricJSON{}
	eg, ctx := errgroup.WithContext(r.Context())
	eg.SetLimit(maxMetricsCalls)
	for _, id := range ids {
		eg.Go(func() error {
			sb, err := g.lookup(ctx, id)
			if errdefs.IsNotFound(err) {
				return nil
			}
			if err != nil {
				return err
			}
			resp, err := g.cfg.API.GetSandboxMetrics(ctx, connect.NewRequest(&v1.GetSandboxMetricsRequest{Id: sb.GetId()}))
			if err != nil {
				err = errdefs.FromConnect(err)
				if errdefs.IsNotFound(err) {
					return nil
				}
				return fmt.Errorf("get sandbox metrics of %s: %w", id, err)
			}
			mu.Lock()
			out[id] = metricOf(resp.Msg.GetMetrics())
			mu.Unlock()
			return nil
		})
	}
	if err := eg.Wait(); err != nil {
		writeErr(w, err)
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"sandboxes": out})
}

// maxMetricsCalls bounds the sandboxes one metrics-of-many request asks at
// once.
const maxMetricsCalls = 16

// parseMetadataQuery decodes the list filter "k=v&k2=v2" (itself
// query-escaped) as E2B does.
func parseMetadataQuery(q string) (map[string]string, error) {
	out := map[string]string{}
	if q == "" {
		return out, nil
	}
	whole, err := url.QueryUnescape(q)
	if err != nil {
		return nil, errdefs.Invalid("metadata", "%q is not query-encoded: %s", q, err)
	}
	for _, kv := range strings.Split(whole, "&") {
		parts := strings.Split(kv, "=")
		if len(parts) != 2 {
			return nil, errdefs.Invalid("metadata", "%q: give key=value pairs joined by &", kv)
		}
		k, err1 := url.QueryUnescape(parts[0])
		v, err2 := url.QueryUnescape(parts[1])
		if err1 != nil || err2 != nil {
			return nil, errdefs.Invalid("metadata", "%q is not query-encoded", kv)
		}
		out[k] = v
	}
	return out, nil
}

type listCursor struct {
	at time.Time
	id string
}

func encodeCursor(c listCursor) string {
	return base64.RawURLEncoding.EncodeToString([]byte(strconv.FormatInt(c.at.UnixNano(), 10) + "__" + c.id))
}

func decodeCursor(s string) (listCursor, error) {
	bad := errdefs.Invalid("nextToken", "%q is not a token this server issued; pass X-Next-Token from the previous page", s)
	b, err := base64.RawURLEncoding.DecodeString(s)
	if err != nil {
		return listCursor{}, bad
	}
	ts, id, ok := strings.Cut(string(b), "__")
	n, err := strconv.ParseInt(ts, 10, 64)
	if !ok || err != nil {
		return listCursor{}, bad
	}
	return listCursor{at: time.Unix(0, n), id: id}, nil
}

// list serves GET /v2/sandboxes (and the deprecated GET /sandboxes, which
// lists running sandboxes only and does not page).
func (g *Gateway) list(v1Route bool) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		q := r.URL.Query()
		md, err := parseMetadataQuery(q.Get("metadata"))
		if err != nil {
			writeErr(w, err)
			return
		}
		labels := map[string]string{labelTeam: principal(r.Context())}
		if err := metadataLabels(md, labels); err != nil {
			writeErr(w, err)
			return
		}
		states := map[string]bool{"running": true, "paused": true}
		if s := q.Get("state"); s != "" && !v1Route {
			states = map[string]bool{}
			for _, st := range strings.Split(s, ",") {
				if st != "running" && st != "paused" {
					writeError(w, http.StatusBadRequest, "state: %q is unknown; use running, paused or both (comma-separated)", st)
					return
				}
				states[st] = true
			}
		}
		if v1Route {
			states = map[string]bool{"running": true}
		}
		order := cmp.Or(q.Get("order"), "desc")
		if order != "asc" && order != "desc" {
			writeError(w, http.StatusBadRequest, "order: %q must be asc or desc", order)
			return
		}
		limit := 100
		if s := q.Get("limit"); s != "" && !v1Route {
			limit, err = strconv.Atoi(s)
			if err != nil || limit < 1 || limit > 100 {
				writeError(w, http.StatusBadRequest, "limit: %q must be a number between 1 and 100", s)
				return
			}
		}
		var after *listCursor
		if s := q.Get("nextToken"); s != "" && !v1Route {
			c, err := decodeCursor(s)
			if err != nil {
				writeErr(w, err)
				return
			}
			after = &c
		}
		var startedAfter time.Time
		if s := q.Get("startedAfter"); s != "" {
			if startedAfter, err = time.Parse(time.RFC3339Nano, s); err != nil {
				writeError(w, http.StatusBadRequest, "startedAfter: %q is not an RFC 3339 date-time, e.g. 2026-01-02T15:04:05Z", s)
				return
			}
		}
		template := q.Get("template")

		resp, err := g.cfg.API.ListSandboxes(r.Context(), connect.NewRequest(&v1.ListSandboxesRequest{Labels: labels}))
		if err != nil {
			writeErr(w, fmt.Errorf("list sandboxes: %w", errdefs.FromConnect(err)))
			return
		}
		var all []*v1.Sandbox
		running := 0
		for _, sb := range resp.Msg.GetSandboxes() {
			st := stateOf(sb)
			if !states[st] || sb.GetSpec().GetLabels()[labelTeam] != principal(r.Context()) {
				continue
			}
			if !startedAfter.IsZero() && sb.GetCreatedAt().AsTime().Before(startedAfter) {
				continue
			}
			if l := sb.GetSpec().GetLabels(); template != "" && l[labelTemplate] != template && l[labelAlias] != template {
				continue
			}
			if st == "running" {
				running++
			}
			all = append(all, sb)
		}
		cmpSb := func(a, b *v1.Sandbox) int {
			c := a.GetCreatedAt().AsTime().Compare(b.GetCreatedAt().AsTime())
			if c == 0 {
				c = strings.Compare(a.GetId(), b.GetId())
			}
			if order == "desc" {
				c = -c
			}
			return c
		}
		slices.SortFunc(all, cmpSb)
		if after != nil {
			probe := &v1.Sandbox{Id: after.id}
			probe.CreatedAt = timestamp(after.at)
			i, _ := slices.BinarySearchFunc(all, probe, cmpSb)
			for i < len(all) && cmpSb(all[i], probe) <= 0 {
				i++
			}
			all = all[i:]
		}
		if len(all) > limit {
			last := all[limit-1]
			w.Header().Set("X-Next-Token", encodeCursor(listCursor{at: last.GetCreatedAt().AsTime(), id: last.GetId()}))
			all = all[:limit]
		}
		if states["running"] {
			w.Header().Set("X-Total-Running", strconv.Itoa(running))
		}
		w.Header().Set("Access-Control-Expose-Headers", "X-Next-Token, X-Total-Running")
		out := make([]detailJSON, 0, len(all))
		for _, sb := range all {
			out = append(out, g.detailOf(sb, false))
		}
		writeJSON(w, http.StatusOK, out)
	}
}

func timestamp(t time.Time) *timestamppb.Timestamp { return timestamppb.New(t) }

// onTimeout is the on_timeout of a sandbox created with E2B's autoPause:
// "pause", else "stop" (E2B's "kill").
func onTimeout(autoPause, filesystemOnly bool) string {
	switch {
	case autoPause && filesystemOnly:
		return sandboxspec.OnTimeoutPauseFilesystem
	case autoPause:
		return sandboxspec.OnTimeoutPause
	}
	return sandboxspec.OnTimeoutStop
}
