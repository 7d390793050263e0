//go:build linux

package e2e

import (
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/vishvananda/netlink"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/test/harness"
)

// TestBuildSandboxReachesOnlyTheMirror: a build's RUN steps reach the
// package mirror the operator's node.build.rule_sets allow (a server in a
// test-made "internet" namespace) and nothing else: not another port of
// the mirror's host, not another host there, not the node's address nor
// the node's side of the build sandbox's own link. The servers answer the
// node's namespace, so what stops the others is the build's policy; and
// when the build is done its network rules, veths and namespaces are gone.
func TestBuildSandboxReachesOnlyTheMirror(t *testing.T) {
	const other = "198.18.0.3"
	mirror := harness.InetIP + ":8080"
	s := &system{harness.NewWith(t, harness.Options{Config: func(cfg map[string]any) {
		harness.Set(cfg, "node.network.rule_sets", map[string]any{
			"mirror": []map[string]any{{"cidr": harness.InetIP + "/32", "protocol": "tcp", "ports": "8080"}},
		})
		harness.Set(cfg, "node.build.rule_sets", []string{"mirror"})
	}})}
	inet := harness.MakeInternet(t, s.NodeNS())
	harness.InNS(t, inet, func() error {
		l, err := netlink.LinkByName("peer")
		if err != nil {
			return err
		}
		return netlink.AddrAdd(l, &netlink.Addr{IPNet: &net.IPNet{IP: net.ParseIP(other).To4(), Mask: net.CIDRMask(24, 32)}})
	})
	serve := func(ns, addr, greeting string) {
		l := harness.ListenIn(t, ns, addr)
		go http.Serve(l, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { fmt.Fprint(w, greeting) }))
	}
	serve(inet, mirror, "hello mirror")
	serve(inet, harness.InetIP+":8081", "hello other port")
	serve(inet, other+":8080", "hello other host")
	serve(s.NodeNS(), "0.0.0.0:8082", "hello node")
	// Every server answers from the node's namespace: only the policy can
	// keep a build from them.
	for _, addr := range []string{mirror, harness.InetIP + ":8081", other + ":8080", harness.UplinkIP + ":8082"} {
		harness.InNS(t, s.NodeNS(), func() error {
			c, err := net.DialTimeout("tcp", addr, 2*time.Second)
			if err != nil {
				return fmt.Errorf("control: the node's namespace cannot reach %s: %w", addr, err)
			}
			return c.Close()
		})
	}
	s.Start()
	if got := s.netCounts(t); got != (netCounts{}) {
		t.Fatalf("before the build: %+v", got)
	}
	dir := t.TempDir()
	df := filepath.Join(dir, "Dockerfile")
	// busybox's wget crashes in glibc's resolver: HTTP/1.0 through nc. The
	// node's side of the sandbox's link is its default gateway.
	get := `printf 'GET / HTTP/1.0\r\n\r\n' | nc -w 2`
	if err := os.WriteFile(df, []byte(`FROM root/busybox
RUN `+get+` `+harness.InetIP+` 8080 > /mirror.txt; grep -q 'hello mirror' /mirror.txt || { echo mirror-unreachable; exit 7; }
RUN gw=$(ip route | awk '/^default/ {print $3}'); echo "gateway $gw"; for a in "`+harness.InetIP+` 8081" "`+other+` 8080" "`+harness.UplinkIP+` 8082" "$gw 8082"; do if `+get+` $a >/dev/null 2>&1; then echo "REACHED $a"; else echo "blocked $a"; fi; done
`), 0o644); err != nil {
		t.Fatal(err)
	}
	out, errOut, code := s.ctl(t, "image", "build", "-f", df, "-t", "team/mirror:v1", dir)
	if code != 0 {
		t.Fatalf("build: exit %d\nstdout %s\nstderr %s", code, out, errOut)
	}
	if strings.Contains(errOut, "REACHED") || strings.Count(errOut, "| blocked ") != 4 || !strings.Contains(errOut, "| gateway 1") {
		t.Fatalf("the build reached more than the mirror (or did not try):\n%s", errOut)
	}
	sb := s.Create(t, &opendsecv1.SandboxSpec{Image: "team/mirror:v1"})
	if r := s.Shell(t, sb.GetId(), "cat /mirror.txt"); !strings.HasSuffix(r.Stdout, "hello mirror") {
		t.Fatalf("the mirror's answer in the image: %q %q", r.Stdout, r.Stderr)
	}
	if _, err := s.Sandboxes().StopSandbox(t.Context(), connect.NewRequest(&opendsecv1.StopSandboxRequest{Id: sb.GetId()})); err != nil {
		t.Fatal(err)
	}
	if got := s.netCounts(t); got != (netCounts{}) {
		t.Fatalf("after the build: %+v; want no sandbox rules, sets, veths or namespaces left", got)
	}
}
