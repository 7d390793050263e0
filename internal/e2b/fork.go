package e2b

import (
	"fmt"
	"net/http"

	"connectrpc.com/connect"

	v1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/sandboxspec"
)

// E2B's fork counts are 1..maxE2BForkCount; OpenDsec makes at most
// sandboxspec.MaxForkCount in one call.
const maxE2BForkCount = 100

// forkResultJSON is E2B's SandboxForkResult: exactly one of the two is set.
type forkResultJSON struct {
	Sandbox *sandboxJSON `json:"sandbox,omitempty"`
	Error   *apiError    `json:"error,omitempty"`
}

// fork is POST /sandboxes/{id}/fork: count (default 1) new running
// sandboxes from the sandbox's files, each with the lifetime timeout
// (default 15 s), answered 201 with one result per fork. OpenDsec's forks
// are all or nothing, so every result is a sandbox; a fork that cannot be
// made fails the whole request (404 for an unknown sandbox).
func (g *Gateway) fork(w http.ResponseWriter, r *http.Request) {
	var body struct {
		Timeout *int64 `json:"timeout"`
		Count   *int64 `json:"count"`
	}
	if err := decode(r, &body); err != nil {
		writeErr(w, err)
		return
	}
	timeout := int64(15)
	if body.Timeout != nil {
		timeout = *body.Timeout
	}
	if err := checkTimeout("timeout", timeout); err != nil {
		writeErr(w, err)
		return
	}
	count := int64(1)
	if body.Count != nil {
		count = *body.Count
	}
	switch {
	case count < 1 || count > maxE2BForkCount:
		writeError(w, http.StatusBadRequest, "count: is %d; give 1..%d", count, maxE2BForkCount)
		return
	case count > sandboxspec.MaxForkCount:
		writeError(w, http.StatusBadRequest, "count: is %d; OpenDsec forks at most %d sandboxes in one call, fork again for more", count, sandboxspec.MaxForkCount)
		return
	}
	sb, err := g.lookup(r.Context(), sandboxID(r))
	if err != nil {
		writeErr(w, err)
		return
	}
	resp, err := g.cfg.API.ForkSandbox(r.Context(), connect.NewRequest(&v1.ForkSandboxRequest{
		SandboxId: sb.GetId(), Count: int32(count), TimeoutSeconds: timeout, RequestId: requestID(),
	}))
	if err != nil {
		err = errdefs.FromConnect(err)
		if errdefs.IsNotFound(err) {
			writeError(w, http.StatusNotFound, "sandbox %q not found", sb.GetId())
			return
		}
		writeErr(w, fmt.Errorf("fork sandbox: %w", err))
		return
	}
	out := make([]forkResultJSON, 0, len(resp.Msg.GetForks()))
	for _, f := range resp.Msg.GetForks() {
		s := g.sandboxOf(f.GetSandbox())
		out = append(out, forkResultJSON{Sandbox: &s})
	}
	writeJSON(w, http.StatusCreated, out)
}
