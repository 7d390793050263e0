package daemon

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	goruntime "runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/miekg/dns"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/config"
	"github.com/kernflux/opendsec/internal/testutil"
)

// makeNetNS bind-mounts a new network namespace (lo up) at path; it plays
// the node's host network, so the test never touches the machine's own
// (the network manager brings its lo up).
func makeNetNS(t *testing.T, path string) {
	t.Helper()
	ns := func() netns.NsHandle {
		goruntime.LockOSThread()
		defer goruntime.UnlockOSThread()
		orig, err := netns.Get()
		if err != nil {
			t.Fatal(err)
		}
		defer orig.Close()
		ns, err := netns.New()
		if err != nil {
			t.Fatal(err)
		}
		if err := netns.Set(orig); err != nil {
			panic("restore network namespace: " + err.Error())
		}
		return ns
	}()
	defer ns.Close()
	if err := os.WriteFile(path, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount(fmt.Sprintf("/proc/self/fd/%d", int(ns)), path, "", unix.MS_BIND, ""); err != nil {
		t.Fatalf("bind-mount netns: %v", err)
	}
	t.Cleanup(func() {
		unix.Unmount(path, unix.MNT_DETACH)
		os.Remove(path)
	})
}

// inNS runs fn on a thread in the network namespace at path.
func inNS(t *testing.T, path string, fn func() error) {
	t.Helper()
	goruntime.LockOSThread()
	defer goruntime.UnlockOSThread()
	orig, err := netns.Get()
	if err != nil {
		t.Fatal(err)
	}
	defer orig.Close()
	ns, err := netns.GetFromPath(path)
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	if err := netns.Set(ns); err != nil {
		t.Fatal(err)
	}
	ferr := fn()
	if err := netns.Set(orig); err != nil {
		panic("restore network namespace: " + err.Error()) // the thread is unusable
	}
	if ferr != nil {
		t.Fatal(ferr)
	}
}

func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// dnsAnswers reports whether the DNS proxy at addr answers over proto.
func dnsAnswers(proto, addr string) error {
	c := &dns.Client{Net: proto, Timeout: time.Second}
	m := new(dns.Msg)
	m.SetQuestion("example.com.", dns.TypeA)
	_, _, err := c.Exchange(m, addr)
	return err
}

// `opendsec up` shut down by its context leaves nothing behind in the
// process: every listener (the four servers and the DNS proxy, UDP and TCP)
// is closed and the goroutines it started are gone.
func TestUpShutdownClosesEverything(t *testing.T) {
	testutil.RequiresRoot(t)
	dd := t.TempDir()
	nodeNS := filepath.Join(dd, "nodens")
	makeNetNS(t, nodeNS)
	agent := filepath.Join(dd, "agent")
	if err := os.WriteFile(agent, []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	cfg := config.Default(dd)
	api, watch, nodeAddr, e2b := freeAddr(t), freeAddr(t), freeAddr(t), freeAddr(t)
	cfg.APIServer.Listen, cfg.APIServer.WatcherAddress = api, "http://"+watch
	cfg.Watcher.Listen, cfg.Watcher.PollIntervalMS = watch, 100
	cfg.Node.Listen, cfg.Node.AgentPath = nodeAddr, agent
	cfg.Nodes = []config.NodeRef{{ID: cfg.Node.ID, Address: "http://" + nodeAddr}}
	cfg.E2B.Listen = e2b
	on := true
	cfg.Node.Network.Enabled = &on
	cfg.Node.Network.NodeNetNS = nodeNS
	cfg.Node.Network.NetNSDir = filepath.Join(dd, "netns")
	cfg.Node.Network.Pool = "100.100.0.0/24"
	const dnsAddr = "100.100.0.1:53" // index 0 of the pool, second address
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}

	base := goruntime.NumGoroutine()
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	ready := filepath.Join(dd, "ready")
	done := make(chan error, 1)
	go func() { done <- Up(ctx, cfg, UpOptions{ReadyFile: ready}) }()
	deadline := time.Now().Add(60 * time.Second)
	for {
		if b, err := os.ReadFile(ready); err == nil && len(b) > 0 {
			break
		}
		select {
		case err := <-done:
			t.Fatalf("up returned before it was ready: %v", err)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatal("up was not ready within 60s")
		}
		time.Sleep(20 * time.Millisecond) // polling a condition with a deadline
	}
	tcpAddrs := []string{api, watch, nodeAddr, e2b}
	for _, a := range tcpAddrs {
		c, err := net.Dial("tcp", a)
		if err != nil {
			t.Fatalf("listener %s while up: %v", a, err)
		}
		c.Close()
	}
	inNS(t, nodeNS, func() error {
		for _, proto := range []string{"udp", "tcp"} {
			if err := dnsAnswers(proto, dnsAddr); err != nil {
				return fmt.Errorf("dns proxy over %s while up: %w", proto, err)
			}
		}
		return nil
	})

	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("up: %v", err)
		}
	case <-time.After(60 * time.Second):
		t.Fatal("up did not return within 60s of its context ending")
	}

	for _, a := range tcpAddrs {
		c, err := net.Dial("tcp", a)
		if err == nil {
			c.Close()
			t.Errorf("listener %s still accepts after shutdown", a)
		} else if !errors.Is(err, syscall.ECONNREFUSED) {
			t.Errorf("listener %s after shutdown: %v; want connection refused", a, err)
		}
	}
	inNS(t, nodeNS, func() error {
		for _, proto := range []string{"udp", "tcp"} {
			if err := dnsAnswers(proto, dnsAddr); err == nil {
				t.Errorf("dns proxy still answers over %s after shutdown", proto)
			}
		}
		return nil
	})

	// Goroutines Up started end with it (idle HTTP/2 client connections
	// close as the servers go; poll for that).
	deadline = time.Now().Add(10 * time.Second)
	for goruntime.NumGoroutine() > base {
		if time.Now().After(deadline) {
			buf := make([]byte, 1<<20)
			buf = buf[:goruntime.Stack(buf, true)]
			t.Fatalf("%d goroutines after shutdown, %d before up:\n%s", goruntime.NumGoroutine(), base, leftStacks(string(buf)))
		}
		time.Sleep(20 * time.Millisecond) // polling a condition with a deadline
	}
}

// leftStacks drops the test framework's own goroutines from a dump.
func leftStacks(dump string) string {
	var keep []string
	for _, g := range strings.Split(dump, "\n\n") {
		if strings.Contains(g, "testing.(*T).Run") || strings.Contains(g, "testing.tRunner") || strings.Contains(g, "testing.(*M)") {
			continue
		}
		keep = append(keep, g)
	}
	return strings.Join(keep, "\n\n")
}
