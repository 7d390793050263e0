//go:build linux

package e2e

import (
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"

	"connectrpc.com/connect"
	"github.com/vishvananda/netlink"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/test/harness"
)

// e2bCreate makes a sandbox of root/busybox through the E2B gateway with
// key and the extra JSON fields (`"allow_internet_access":false`), and
// stops it when the test ends.
func (s *system) e2bCreate(t *testing.T, key, extra string) string {
	t.Helper()
	body := `{"templateID":"root/busybox","timeout":300` + extra + `}`
	req, _ := http.NewRequestWithContext(t.Context(), http.MethodPost, "http://"+s.E2BAddr()+"/sandboxes", strings.NewReader(body))
	req.Header.Set("X-API-Key", key)
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	var c struct {
		SandboxID string `json:"sandboxID"`
	}
	if resp.StatusCode != http.StatusCreated || json.Unmarshal(b, &c) != nil || c.SandboxID == "" {
		t.Fatalf("E2B create %s: %d %s", body, resp.StatusCode, b)
	}
	t.Cleanup(func() {
		s.Sandboxes().StopSandbox(t.Context(), connect.NewRequest(&opendsecv1.StopSandboxRequest{Id: c.SandboxID}))
	})
	return c.SandboxID
}

// TestE2BDefaultInternet: an E2B sandbox created with no network option
// reaches a public address (E2B's default), but not a private one, cloud
// metadata or the node itself; with allow_internet_access false it reaches
// nothing. The native API stays default-deny.
func TestE2BDefaultInternet(t *testing.T) {
	s := newSystem(t)
	inet := harness.MakeInternet(t, s.NodeNS())
	// The "internet" namespace also holds a private address and a
	// metadata address, routed from the node's namespace like a LAN and a
	// cloud's metadata service would be.
	const private, metadata = "10.99.0.2", "169.254.169.254"
	harness.InNS(t, inet, func() error {
		l, err := netlink.LinkByName("peer")
		if err != nil {
			return err
		}
		for _, a := range []string{private, metadata} {
			if err := netlink.AddrAdd(l, &netlink.Addr{IPNet: &net.IPNet{IP: net.ParseIP(a).To4(), Mask: net.CIDRMask(32, 32)}}); err != nil {
				return fmt.Errorf("add %s: %w", a, err)
			}
		}
		return nil
	})
	harness.InNS(t, s.NodeNS(), func() error {
		l, err := netlink.LinkByName("uplink")
		if err != nil {
			return err
		}
		for _, a := range []string{private, metadata} {
			if err := netlink.RouteAdd(&netlink.Route{LinkIndex: l.Attrs().Index, Dst: &net.IPNet{IP: net.ParseIP(a).To4(), Mask: net.CIDRMask(32, 32)}, Gw: net.ParseIP(harness.InetIP)}); err != nil {
				return fmt.Errorf("route %s: %w", a, err)
			}
		}
		return nil
	})
	serve := func(ns, addr string) {
		l := harness.ListenIn(t, ns, addr)
		go http.Serve(l, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { fmt.Fprint(w, "hello "+addr) }))
	}
	public, lan, meta, node := harness.InetIP+":8080", private+":8080", metadata+":80", harness.UplinkIP+":8082"
	serve(inet, public)
	serve(inet, lan)
	serve(inet, meta)
	serve(s.NodeNS(), node)
	s.Start()
	key := s.E2BKey(t, "team-net")

	open := s.e2bCreate(t, key, "")
	s.reaches(t, open, public)
	for _, addr := range []string{lan, meta, node} {
		s.blocked(t, open, addr)
	}

	closed := s.e2bCreate(t, key, `,"allow_internet_access":false`)
	for _, addr := range []string{public, lan, meta, node} {
		s.blocked(t, closed, addr)
	}

	// An explicit allowOut entry may name the private address.
	lanOK := s.e2bCreate(t, key, `,"network":{"allowOut":["`+private+`"],"denyOut":["0.0.0.0/0"]}`)
	s.reaches(t, lanOK, lan)
	s.blocked(t, lanOK, public)

	native := s.create(t, nil)
	s.blocked(t, native.GetId(), public)
}
