package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"time"

	specs "github.com/opencontainers/runtime-spec/specs-go"
)

// The agent's socket inside a sandbox's bundle (internal/runtime/container).
const agentSocket = "run/agent.sock"

// breakdownPhase splits our cold create time (skip_warm_pool) into its parts. It copies the
// config.json our node wrote for a live sandbox and replays the node's
// steps by hand on a fresh bundle of the same rootfs: `runc create`,
// `runc start`, then the agent's first /health answer (polled every
// millisecond). Interleaved with real CreateSandbox calls, which return
// after the start without waiting for the agent, so ours minus the replay's
// create + start is what the API path (apiserver, node bookkeeping) adds.
func (b *bench) breakdownPhase(ctx context.Context, r *report) error {
	if b.cfg.breakdown == 0 {
		return nil
	}
	sb, _, err := b.createWith(ctx, true)
	if err != nil {
		return err
	}
	out, err := exec.CommandContext(ctx, ociBinary(b.cfg.runc, b.cfg.stateRoot, sb.GetId()), "--root", b.cfg.stateRoot, "state", sb.GetId()).Output()
	if err != nil {
		return fmt.Errorf("runc state %s (flag -state-root): %w", sb.GetId(), err)
	}
	var st struct {
		Bundle string `json:"bundle"`
	}
	if err := json.Unmarshal(out, &st); err != nil || st.Bundle == "" {
		return fmt.Errorf("decode runc state of %s: %q", sb.GetId(), out)
	}
	raw, err := os.ReadFile(filepath.Join(st.Bundle, "config.json"))
	if err != nil {
		return fmt.Errorf("read our config.json: %w", err)
	}
	var ours specs.Spec
	if err := json.Unmarshal(raw, &ours); err != nil {
		return fmt.Errorf("decode our config.json: %w", err)
	}
	// The sandbox's policed network namespace goes with it; the replays get
	// a fresh (empty) one, as runc makes when no path is given.
	lin := *ours.Linux
	lin.Namespaces = slices.Clone(lin.Namespaces)
	for i := range lin.Namespaces {
		if lin.Namespaces[i].Type == specs.NetworkNamespace {
			lin.Namespaces[i].Path = ""
		}
	}
	ours.Linux = &lin
	// The node binds the agent's socket before the container exists and
	// init inherits it (--listen-fd); the replay does the same.
	listenFD := ours.Process != nil && slices.Contains(ours.Process.Args, "--listen-fd")
	// Regular files bound from the bundle (the agent's seccomp filter) are
	// gone after the stop: keep their bytes for the replays.
	b.base.files = map[string][]byte{}
	for _, m := range ours.Mounts {
		rel, ok := strings.CutPrefix(m.Source, st.Bundle+"/")
		if fi, err := os.Stat(m.Source); ok && err == nil && fi.Mode().IsRegular() {
			data, err := os.ReadFile(m.Source)
			if err != nil {
				return fmt.Errorf("read bind source %s: %w", m.Source, err)
			}
			b.base.files[rel] = data
		}
	}
	if err := b.stop(ctx, sb.GetId()); err != nil {
		return err
	}

	for i := -b.cfg.warmup; i < b.cfg.breakdown; i++ {
		if err := b.settle(ctx); err != nil {
			return err
		}
		sb, total, err := b.createWith(ctx, true)
		if err != nil {
			return err
		}
		if err := b.stop(ctx, sb.GetId()); err != nil {
			return err
		}
		if err := b.settle(ctx); err != nil {
			return err
		}
		c, err := b.base.prepareSpec(ours, st.Bundle)
		if err != nil {
			return err
		}
		create := b.base.create
		if listenFD {
			create = func(ctx context.Context, c *runcContainer) (time.Duration, error) {
				return b.base.createListening(ctx, c, filepath.Join(c.bundle, agentSocket))
			}
		}
		cd, err := create(ctx, c)
		if err != nil {
			return err
		}
		sd, err := b.base.start(ctx, c)
		if err != nil {
			return err
		}
		ad, err := waitHealth(ctx, filepath.Join(c.bundle, agentSocket), 20*time.Second)
		if err != nil {
			return err
		}
		if err := b.base.remove(ctx, c); err != nil {
			return err
		}
		if i >= 0 {
			r.bdOurs = append(r.bdOurs, total)
			r.bdCreate = append(r.bdCreate, cd)
			r.bdStart = append(r.bdStart, sd)
			r.bdAgent = append(r.bdAgent, ad)
			r.bdSum = append(r.bdSum, cd+sd)
		}
	}
	return nil
}

// waitHealth polls GET /health on the agent's unix socket every millisecond
// until it answers 200 or 204, and returns how long that took.
func waitHealth(ctx context.Context, sock string, timeout time.Duration) (time.Duration, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	client := &http.Client{Transport: &http.Transport{
		DisableKeepAlives: true,
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", sock)
		},
	}}
	defer client.CloseIdleConnections()
	start := time.Now()
	var last error
	for {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://agent/health", nil)
		if err != nil {
			return 0, fmt.Errorf("agent health request: %w", err)
		}
		resp, err := client.Do(req)
		if err == nil {
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK || resp.StatusCode == http.StatusNoContent {
				return time.Since(start), nil
			}
			err = fmt.Errorf("status %d", resp.StatusCode)
		}
		last = err
		select {
		case <-ctx.Done():
			return 0, fmt.Errorf("agent at %s did not answer /health within %s: %w", sock, timeout, last)
		case <-time.After(time.Millisecond):
		}
	}
}
