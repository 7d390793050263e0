package vm

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/osthread"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/runtime/runtimetest"
	"github.com/kernflux/opendsec/internal/vmchan"
)

// The guest side of every sandbox's network, as the node's netpolicy gives it.
var (
	testGuestAddr = netip.MustParsePrefix("169.254.0.21/30")
	testGateway   = netip.MustParseAddr("169.254.0.22")
	testGuestMAC  = net.HardwareAddr{0x02, 0x0d, 0x5e, 0x00, 0x00, 0x21}
)

// tapNetNS is a network namespace the test made with tap0 in it as the
// guest's gateway (the node's netpolicy does the same in tap mode).
type tapNetNS struct{ name, path string }

func newTapNetNS(name string) (*tapNetNS, error) {
	n := &tapNetNS{name: name, path: "/run/netns/" + name}
	_ = exec.Command("ip", "netns", "del", name).Run() // a leftover of a killed run
	for _, args := range [][]string{
		{"netns", "add", name},
		{"-n", name, "tuntap", "add", "tap0", "mode", "tap"},
		{"-n", name, "addr", "add", testGateway.String() + "/30", "dev", "tap0"},
		{"-n", name, "link", "set", "tap0", "up"},
		// The node's netpolicy pins the guest's neighbour entry: a
		// guest with another MAC (a fork) is reached only once the
		// backend repoints it.
		{"-n", name, "neigh", "replace", testGuestAddr.Addr().String(), "lladdr", testGuestMAC.String(), "dev", "tap0", "nud", "permanent"},
		{"-n", name, "link", "set", "lo", "up"},
	} {
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			n.close()
			return nil, fmt.Errorf("ip %v: %v: %s", args, err, out)
		}
	}
	return n, nil
}

func (n *tapNetNS) close() { _ = exec.Command("ip", "netns", "del", n.name).Run() }

func (n *tapNetNS) attachment() runtime.NetworkAttachment {
	return runtime.NetworkAttachment{Mode: runtime.NetworkTap, NetNS: n.path, Device: "tap0", GuestAddr: testGuestAddr, Gateway: testGateway, MAC: testGuestMAC}
}

// listen opens a TCP listener inside the namespace.
func (n *tapNetNS) listen(addr string) (net.Listener, error) {
	ch := make(chan any, 1)
	osthread.Throwaway(func() { // the thread is left in its netns and ends with the function
		fd, err := unix.Open(n.path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			ch <- err
			return
		}
		defer func() { _ = unix.Close(fd) }()
		if err := unix.Setns(fd, unix.CLONE_NEWNET); err != nil {
			ch <- err
			return
		}
		l, err := net.Listen("tcp", addr)
		if err != nil {
			ch <- err
			return
		}
		ch <- l
	})
	switch v := (<-ch).(type) {
	case net.Listener:
		return v, nil
	case error:
		return nil, v
	}
	panic("unreachable")
}

// sharedGuestSpec is the shared VM's spec: a tap in its own namespace and
// guest settings that go over the configuration disk.
func sharedGuestSpec(t testing.TB, id, dir string, ns *tapNetNS) runtime.Spec {
	return runtime.Spec{ID: id, StateDir: dir, Rootfs: guestRootfs(t), Resources: guestRes(16), Network: ns.attachment(),
		Guest: runtime.Guest{Env: []string{"OPENDSEC_TEST_ENV=from the config disk"}, Workdir: "/tmp", Nameservers: []string{testGateway.String()}}}
}

// TestGuestNetworkAndConfig: the guest init configures eth0 (the
// attachment's fixed address and MAC), lo and the default route, so the
// guest reaches a server on its gateway in the sandbox's namespace; the
// env, workdir and nameservers of the spec arrive through the config disk.
func TestGuestNetworkAndConfig(t *testing.T) {
	r, id := guestVM(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	l, err := sharedGuest.ns.listen(testGateway.String() + ":18080")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = l.Close() }()
	peers := make(chan string, 1)
	go func() {
		c, err := l.Accept()
		if err != nil {
			return
		}
		peers <- c.RemoteAddr().String()
		_, _ = c.Write([]byte("hello from the gateway\n"))
		_ = c.Close()
	}()
	res, err := runtimetest.Run(ctx, r, id, "", "/bin/sh", "-c",
		"ip -4 -o addr show dev eth0; ip link show dev eth0; ip route; ip -o link show dev lo; echo env=$OPENDSEC_TEST_ENV; pwd; cat /etc/resolv.conf; "+
			"echo | nc -w 10 "+testGateway.String()+" 18080")
	if err != nil {
		t.Fatal(err)
	}
	out := res.Stdout
	for _, want := range []string{
		"inet " + testGuestAddr.String(), "link/ether " + testGuestMAC.String(), "default via " + testGateway.String() + " dev eth0",
		"lo: <LOOPBACK,UP", "env=from the config disk\n/tmp\n", "nameserver " + testGateway.String() + "\n", "hello from the gateway\n",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("guest output lacks %q:\n%s\nstderr: %s", want, out, res.Stderr)
		}
	}
	select {
	case p := <-peers:
		if host, _, _ := net.SplitHostPort(p); host != testGuestAddr.Addr().String() {
			t.Errorf("the gateway's server saw %s, want the guest address %s", p, testGuestAddr.Addr())
		}
	case <-ctx.Done():
		t.Fatal("the gateway's server saw no connection")
	}
}

// TestGuestIdentityRoute: POST /opendsec/identity through the agent port
// is answered by the guest init (the agent does not know it): it sets the
// hostname and steps the clock; a body that is no identity is refused.
func TestGuestIdentityRoute(t *testing.T) {
	r, id := guestVM(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	sb, err := r.get(id)
	if err != nil {
		t.Fatal(err)
	}
	sb.mu.Lock()
	old := sb.st.Hostname
	sb.st.Hostname = "renamed-by-identity"
	sb.mu.Unlock()
	defer func() {
		sb.mu.Lock()
		sb.st.Hostname = old
		sb.mu.Unlock()
		_ = r.setIdentity(context.Background(), sb)
	}()
	if err := r.setIdentity(ctx, sb); err != nil {
		t.Fatal(err)
	}
	res, err := runtimetest.Run(ctx, r, id, "", "/bin/sh", "-c", "hostname; date +%s")
	if err != nil {
		t.Fatal(err)
	}
	sc := bufio.NewScanner(strings.NewReader(res.Stdout))
	if !sc.Scan() || sc.Text() != "renamed-by-identity" {
		t.Fatalf("hostname after identity: %q, want renamed-by-identity", res.Stdout)
	}
	if sc.Scan() {
		var sec int64
		_, _ = fmt.Sscan(sc.Text(), &sec)
		if d := time.Since(time.Unix(sec, 0)); d < -5*time.Second || d > 5*time.Second {
			t.Errorf("guest clock is %s off the host's after identity", d)
		}
	}
	hc := runtimetest.AgentHTTPClient(r, id)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://agent"+vmchan.IdentityPath, strings.NewReader("{not json"))
	if err != nil {
		t.Fatal(err)
	}
	resp, err := hc.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	if resp.StatusCode != 400 {
		t.Fatalf("identity with a broken body: %d, want 400", resp.StatusCode)
	}
}

// TestGuestForkOwnMAC: every fork's NIC gets its own MAC (the attachment's
// address stays), and each fork still reaches a server on its gateway in
// its own namespace, whose neighbour entry for the guest the node pins.
func TestGuestForkOwnMAC(t *testing.T) {
	r, src := sharedHolder(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	specs := forkSpecs(t, "mac", 2)
	if _, err := r.Fork(ctx, src, specs); err != nil {
		t.Fatalf("fork: %v", err)
	}
	for _, s := range specs {
		t.Cleanup(func() { _ = r.Delete(context.Background(), s.ID) })
		if err := r.Start(ctx, s.ID); err != nil {
			t.Fatalf("start fork %s: %v", s.ID, err)
		}
	}
	macs := map[string]string{testGuestMAC.String(): src}
	for i, s := range specs {
		ns := &tapNetNS{name: "mac" + strconv.Itoa(i) + "-" + strconv.Itoa(os.Getpid())}
		ns.path = "/run/netns/" + ns.name
		l, err := ns.listen(testGateway.String() + ":18081")
		if err != nil {
			t.Fatal(err)
		}
		go func() {
			c, err := l.Accept()
			if err != nil {
				return
			}
			_, _ = c.Write([]byte("hello " + s.ID + "\n"))
			_ = c.Close()
		}()
		out := guestRun(t, r, s.ID, "cat /sys/class/net/eth0/address; ip -4 -o addr show dev eth0; echo | nc -w 10 "+testGateway.String()+" 18081")
		_ = l.Close()
		mac, rest, _ := strings.Cut(out, "\n")
		if other, dup := macs[mac]; dup {
			t.Errorf("fork %s has MAC %s, as %s", s.ID, mac, other)
		}
		macs[mac] = s.ID
		if !strings.Contains(rest, "inet "+testGuestAddr.String()) {
			t.Errorf("fork %s lost the attachment's address: %s", s.ID, rest)
		}
		if !strings.Contains(rest, "hello "+s.ID) {
			t.Errorf("fork %s (MAC %s) did not reach its gateway's server: %s", s.ID, mac, rest)
		}
		neigh, _ := exec.Command("ip", "-n", ns.name, "neigh", "show", "dev", "tap0").CombinedOutput()
		if !strings.Contains(string(neigh), mac) {
			t.Errorf("namespace of fork %s: neighbour entries %q do not name its MAC %s", s.ID, neigh, mac)
		}
	}
}
