package runtime

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"sort"
	"strings"
	"sync"

	"github.com/kernflux/opendsec/internal/errdefs"
)

// Env is what a node gives every backend it opens.
type Env struct {
	// NodeID is the node's ID.
	NodeID string
	// StateDir is a node-local directory the backend may use for its own
	// state (not per sandbox: sandboxes get Spec.StateDir).
	StateDir string
	// MaxUploadBytes caps one file written through a sandbox's file API
	// (node.max_upload_mb); 0 leaves the backend's agent at its default.
	MaxUploadBytes int64
	// Limits are the node's process and file limits (node config);
	// zero fields mean the backend's defaults.
	Limits NodeLimits
}

// NodeLimits bound what sandboxes may use of the host's processes and
// files (node.max_pids_limit, node.total_pids_limit, node.nofile_limit in
// the config). A backend enforces what applies to it.
type NodeLimits struct {
	// MaxPidsLimit is the largest Resources.PidsLimit a sandbox may have.
	MaxPidsLimit int64
	// TotalPidsLimit bounds the processes and threads of all the node's
	// sandboxes together.
	TotalPidsLimit int64
	// NofileLimit is every sandbox process's RLIMIT_NOFILE.
	NofileLimit int64
}

// Factory builds a backend from its section of the config
// (node.backends.<name>, raw JSON; empty when the section is "{}" or
// absent). It must refuse unknown fields, naming them.
type Factory func(ctx context.Context, env Env, config json.RawMessage) (Runtime, error)

var (
	regMu     sync.Mutex
	factories = map[string]Factory{}
)

// Register makes a backend available under name. Backends call it from an
// init function; a program picks the backends it can run by importing
// their packages. Registering a name twice panics.
func Register(name string, f Factory) {
	regMu.Lock()
	defer regMu.Unlock()
	if _, dup := factories[name]; dup {
		panic(fmt.Sprintf("runtime: backend %q registered twice", name))
	}
	factories[name] = f
}

// Registered returns the names of the registered backends, sorted.
func Registered() []string {
	regMu.Lock()
	defer regMu.Unlock()
	out := make([]string, 0, len(factories))
	for k := range factories {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// Open builds every backend named in configs (name → its config section).
// Errors name the config field. Backends hold no node resources until
// their first Create, so a failed Open leaves nothing to close.
func Open(ctx context.Context, env Env, configs map[string]json.RawMessage) (map[string]Runtime, error) {
	names := make([]string, 0, len(configs))
	for k := range configs {
		names = append(names, k)
	}
	sort.Strings(names)
	out := make(map[string]Runtime, len(names))
	for _, name := range names {
		regMu.Lock()
		f, ok := factories[name]
		regMu.Unlock()
		field := "node.backends." + name
		if !ok {
			return nil, errdefs.Invalid(field, "no backend %q in this build (have %s); remove the section or use a build with that backend", name, strings.Join(Registered(), ", "))
		}
		raw := configs[name]
		if len(raw) == 0 || string(raw) == "null" {
			raw = json.RawMessage("{}")
		}
		rt, err := f(ctx, env, raw)
		if err != nil {
			return nil, fmt.Errorf("open backend %s: %w", name, err)
		}
		if got := rt.Info().Name; got != name {
			return nil, errdefs.New(errdefs.ErrInternal, "backend registered as %q calls itself %q", name, got)
		}
		out[name] = rt
	}
	return out, nil
}

// DecodeConfig decodes a backend's config section into v, refusing unknown
// fields; errors name node.backends.<name>.
func DecodeConfig(name string, raw json.RawMessage, v any) error {
	if len(raw) == 0 {
		return nil
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return errdefs.Invalid("node.backends."+name, "%v; see docs/operations.md for the fields", err)
	}
	return nil
}
