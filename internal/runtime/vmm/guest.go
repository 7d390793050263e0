package vmm

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"time"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/vmchan"
)

// AgentHTTP is an HTTP client whose every request goes over a new
// connection dial makes to the guest's agent port (the guest init answers
// its own routes there, vmchan.IdentityPath and vmchan.BalloonPath; the
// agent the rest).
func AgentHTTP(dial func(ctx context.Context) (net.Conn, error)) *http.Client {
	return &http.Client{Transport: &http.Transport{
		DialContext:       func(ctx context.Context, _, _ string) (net.Conn, error) { return dial(ctx) },
		DisableKeepAlives: true,
	}}
}

// WaitHealth does GET /health through hc until the agent answers 204
// (nil), or until timeout passes, ctx ends or exited (the VMM's end) is
// closed: then the last try's error. With attempt > 0 each try gets that
// long; failed, when not nil, runs after each failed one.
func WaitHealth(ctx context.Context, hc *http.Client, timeout time.Duration, exited <-chan struct{}, attempt time.Duration, failed func()) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	go func() {
		select {
		case <-exited:
			cancel()
		case <-ctx.Done():
		}
	}()
	wait := 5 * time.Millisecond
	for {
		err := getHealth(ctx, hc, attempt)
		if err == nil {
			return nil
		}
		if failed != nil {
			failed()
		}
		t := time.NewTimer(wait)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return err
		}
		wait = min(2*wait, 100*time.Millisecond)
	}
}

func getHealth(ctx context.Context, hc *http.Client, attempt time.Duration) error {
	if attempt > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, attempt)
		defer cancel()
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://agent/health", nil)
	if err != nil {
		return err
	}
	resp, err := hc.Do(req)
	if err != nil {
		return err
	}
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusNoContent {
		return fmt.Errorf("GET /health: status %d", resp.StatusCode)
	}
	return nil
}

// NewIdentity is the identity (vmchan.Identity) of a guest restored from
// a snapshot: its own hostname and network attachment, 64 bytes of fresh
// entropy for its RNG and the host's clock.
func NewIdentity(hostname, mac, addr, gateway string) (vmchan.Identity, error) {
	id := vmchan.Identity{Hostname: hostname, MAC: mac, Addr: addr, Gateway: gateway, Entropy: make([]byte, 64)}
	if _, err := rand.Read(id.Entropy); err != nil {
		return id, errdefs.New(errdefs.ErrInternal, "identity entropy: %w", err)
	}
	id.TimeNS = time.Now().UnixNano()
	return id, nil
}

// PostGuest POSTs v as JSON to the guest init's route path through hc
// (AgentHTTP); the guest answers 204. A guest that cannot be reached is
// errdefs.ErrUnavailable; any other answer is errdefs.ErrInternal with
// its status and text.
func PostGuest(ctx context.Context, hc *http.Client, path string, v any) error {
	body, err := json.Marshal(v)
	if err != nil {
		return errdefs.New(errdefs.ErrInternal, "%w", err)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://agent"+path, bytes.NewReader(body))
	if err != nil {
		return errdefs.New(errdefs.ErrInternal, "%w", err)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := hc.Do(req)
	if err != nil {
		return errdefs.New(errdefs.ErrUnavailable, "%w", err)
	}
	defer func() { _ = resp.Body.Close() }()
	if resp.StatusCode != http.StatusNoContent {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		return errdefs.New(errdefs.ErrInternal, "the guest answered %d: %s", resp.StatusCode, bytes.TrimSpace(msg))
	}
	return nil
}
