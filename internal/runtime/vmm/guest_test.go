package vmm

import (
	"context"
	"encoding/json"
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/vmchan"
)

// guestServer is a stand-in for the guest's agent port on loopback and an
// AgentHTTP client of it.
func guestServer(t *testing.T, h http.HandlerFunc) *http.Client {
	t.Helper()
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	addr := srv.Listener.Addr().String()
	return AgentHTTP(func(ctx context.Context) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "tcp", addr)
	})
}

// TestWaitHealth: it returns once the agent answers 204 (after failures,
// each reported), the last failure when the timeout passes, and at once
// when the VMM has exited.
func TestWaitHealth(t *testing.T) {
	var tries atomic.Int32
	hc := guestServer(t, func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/health" || tries.Add(1) < 3 {
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		w.WriteHeader(http.StatusNoContent)
	})
	var failed int
	if err := WaitHealth(context.Background(), hc, 10*time.Second, nil, time.Second, func() { failed++ }); err != nil || failed != 2 {
		t.Fatalf("WaitHealth: %v after %d failures; want nil after 2", err, failed)
	}

	down := guestServer(t, func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusServiceUnavailable) })
	err := WaitHealth(context.Background(), down, 50*time.Millisecond, nil, 0, nil)
	if err == nil || !strings.Contains(err.Error(), "status 503") {
		t.Fatalf("WaitHealth of an agent that never answers 204: %v; want the last answer", err)
	}

	exited := make(chan struct{})
	close(exited)
	t0 := time.Now()
	if err := WaitHealth(context.Background(), down, time.Minute, exited, 0, nil); err == nil || time.Since(t0) > 10*time.Second {
		t.Fatalf("WaitHealth with the VMM gone: %v after %s; want an error at once", err, time.Since(t0))
	}
}

// TestPostGuest: the body goes as JSON to the route, 204 is success, any
// other answer is internal with the guest's text, no guest is unavailable.
func TestPostGuest(t *testing.T) {
	var got vmchan.Identity
	hc := guestServer(t, func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost || r.Header.Get("Content-Type") != "application/json" {
			http.Error(w, "bad request", http.StatusBadRequest)
			return
		}
		if r.URL.Path != vmchan.IdentityPath {
			http.Error(w, "no such route", http.StatusNotFound)
			return
		}
		_ = json.NewDecoder(r.Body).Decode(&got)
		w.WriteHeader(http.StatusNoContent)
	})
	id, err := NewIdentity("h1", "02:00:00:00:00:01", "10.0.0.2/24", "10.0.0.1")
	if err != nil || len(id.Entropy) != 64 || id.TimeNS == 0 {
		t.Fatalf("NewIdentity: %+v, %v; want 64 bytes of entropy and the clock", id, err)
	}
	if err := PostGuest(context.Background(), hc, vmchan.IdentityPath, id); err != nil {
		t.Fatal(err)
	}
	if got.Hostname != "h1" || got.Addr != "10.0.0.2/24" || string(got.Entropy) != string(id.Entropy) {
		t.Fatalf("the guest got %+v; want %+v", got, id)
	}
	err = PostGuest(context.Background(), hc, vmchan.BalloonPath, vmchan.Balloon{})
	if !errors.Is(err, errdefs.ErrInternal) || !strings.Contains(err.Error(), "404") || !strings.Contains(err.Error(), "no such route") {
		t.Fatalf("PostGuest to a route the guest lacks: %v; want internal with its answer", err)
	}
	gone := AgentHTTP(func(context.Context) (net.Conn, error) { return nil, errors.New("no guest") })
	if err := PostGuest(context.Background(), gone, vmchan.IdentityPath, id); !errors.Is(err, errdefs.ErrUnavailable) {
		t.Fatalf("PostGuest with no guest: %v; want unavailable", err)
	}
}
