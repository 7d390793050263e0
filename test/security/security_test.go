//go:build linux

// Package security is issue 11's regression suite: one end-to-end test per
// security finding and per incident, run against real `opendsec up`
// systems (test/harness) as root by `make test`. README.md maps every
// finding and incident to its test and says how to add one.
//
// TestSecurity shares one system between the checks that do not disturb
// each other (its subtests); tests that restart or reconfigure a system
// start their own.
package security

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/miekg/dns"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/internal/node"
	opendsec "github.com/kernflux/opendsec/sdk/go"
	"github.com/kernflux/opendsec/test/harness"
)

func TestMain(m *testing.M) { harness.Main(m) }

// sharedCPU is the CPU quota of the shared system's node: node.cpu cores
// times node.DefaultCPUOvercommit (more than the machine has: placement counts
// reservations, not real use).
const (
	sharedCores = 1
	sharedCPU   = int(sharedCores * node.DefaultCPUOvercommit)
)

// TestSecurity runs the checks that share one system. Each check is
// TestSecurity/<Name>; run one with -run 'TestSecurity/<Name>$'.
func TestSecurity(t *testing.T) {
	e := newEnv(t)
	for _, c := range []struct {
		name string
		fn   func(*testing.T, *env)
	}{
		// Findings of issue 11.
		// PlacementChurn first: it needs the node empty (a dead
		// sandbox's tombstone stays listed for a while).
		{"PlacementChurn", checkPlacementChurn},             // 7
		{"ExecOutputCap", checkExecOutputCap},               // 1, and the paper's `yes` output
		{"ExecOutputSlowReader", checkExecOutputSlowReader}, // 1
		{"AgentPathsFileAPI", checkAgentPathsFileAPI},       // 4
		{"DeadSandboxReported", checkDeadSandboxReported},   // 5
		{"DNSPrivateAnswers", checkDNSPrivateAnswers},       // 6
		// Incidents of the DSec paper.
		{"ForgedAgentRPC", checkForgedAgentRPC},
		{"BinaryOverwrite", checkBinaryOverwrite},
		{"KernelMemoryProc", checkKernelMemoryProc},
		// What held in the red-team pass.
		{"Seccomp", checkSeccomp},
		{"Capabilities", checkCapabilities},
		{"MaskedProc", checkMaskedProc},
		{"MountModulePtrace", checkMountModulePtrace},
		{"AgentReadOnly", checkAgentReadOnly},
		{"FilePathTraversal", checkFilePathTraversal},
		{"DNSExfiltration", checkDNSExfiltration},
		{"E2BAccessToken", checkE2BAccessToken},
		{"E2BSignedURL", checkE2BSignedURL},
	} {
		t.Run(c.name, func(t *testing.T) { c.fn(t, e) })
	}
}

// env is the shared system: a node with sharedCPU CPUs, a test
// "internet" namespace beside the node's with a DNS server (the node's
// upstream) and an HTTP server, and refuse_private_dns_answers on.
type env struct {
	*harness.System
	c      *opendsec.Client
	probe  string // host path of the probe binary (test/security/probe)
	e2bKey string
	dns    *fakeDNS
}

// Names the fake upstream answers.
const (
	publicName  = "public.sec.test"  // harness.InetIP
	privateName = "private.sec.test" // 10.9.9.9 (RFC 1918)
	exfilZone   = "exfil.sec.test"   // never allowed: queries must not leave the node
)

func newEnv(t *testing.T) *env {
	s := harness.NewWith(t, harness.Options{Config: func(cfg map[string]any) {
		harness.Set(cfg, "node.cpu", sharedCores)
		harness.Set(cfg, "node.network.dns_upstream", []string{harness.InetIP + ":53"})
		harness.Set(cfg, "node.network.refuse_private_dns_answers", true)
	}})
	inet := harness.MakeInternet(t, s.NodeNS())
	e := &env{System: s, dns: startFakeDNS(t, inet)}
	l := harness.ListenIn(t, inet, harness.InetIP+":8080")
	go serveHello(l)
	s.Start()
	e.c = s.Client(t)
	e.probe = harness.BuildPackage(t, "./test/security/probe", "probe")
	e.e2bKey = s.E2BKey(t, "sec")
	return e
}

func serveHello(l net.Listener) {
	for {
		c, err := l.Accept()
		if err != nil {
			return
		}
		go func() {
			defer c.Close()
			c.SetDeadline(time.Now().Add(5 * time.Second))
			bufio.NewReader(c).ReadString('\n')
			fmt.Fprint(c, "HTTP/1.0 200 OK\r\nContent-Length: 5\r\n\r\nhello")
		}()
	}
}

// fakeDNS is the node's upstream resolver, in the test's internet
// namespace: it answers publicName and privateName and records every name
// it is asked.
type fakeDNS struct {
	asked chan string
}

func startFakeDNS(t *testing.T, inet string) *fakeDNS {
	f := &fakeDNS{asked: make(chan string, 4096)}
	h := dns.HandlerFunc(func(w dns.ResponseWriter, r *dns.Msg) {
		m := new(dns.Msg)
		m.SetReply(r)
		for _, q := range r.Question {
			select {
			case f.asked <- strings.ToLower(q.Name):
			default:
			}
			if q.Qtype != dns.TypeA {
				continue
			}
			ip := ""
			switch strings.ToLower(q.Name) {
			case publicName + ".":
				ip = harness.InetIP
			case privateName + ".":
				ip = "10.9.9.9"
			}
			if ip != "" {
				m.Answer = append(m.Answer, &dns.A{Hdr: dns.RR_Header{Name: q.Name, Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: 60}, A: net.ParseIP(ip)})
			}
		}
		if len(m.Answer) == 0 {
			m.Rcode = dns.RcodeNameError
		}
		w.WriteMsg(m)
	})
	var pc net.PacketConn
	harness.InNS(t, inet, func() error {
		var err error
		pc, err = net.ListenPacket("udp", harness.InetIP+":53")
		return err
	})
	tl := harness.ListenIn(t, inet, harness.InetIP+":53")
	udp := &dns.Server{PacketConn: pc, Handler: h}
	tcp := &dns.Server{Listener: tl, Handler: h}
	go udp.ActivateAndServe()
	go tcp.ActivateAndServe()
	t.Cleanup(func() { udp.Shutdown(); tcp.Shutdown() })
	return f
}

// drainAsked empties the record of asked names and returns it.
func (f *fakeDNS) drainAsked() []string {
	var out []string
	for {
		select {
		case n := <-f.asked:
			out = append(out, n)
		default:
			return out
		}
	}
}

// withProbe uploads the probe binary to /tmp/probe in sandbox id.
func (e *env) withProbe(t *testing.T, id string) {
	t.Helper()
	f, err := os.Open(e.probe)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	st, _ := f.Stat()
	if _, err := e.c.WriteFile(t.Context(), id, "/tmp/probe", f, st.Size()); err != nil {
		t.Fatalf("upload the probe: %v", err)
	}
	if r := e.Shell(t, id, "chmod 755 /tmp/probe"); r.Exit.GetExitCode() != 0 {
		t.Fatalf("chmod the probe: %+v", r)
	}
}

// runProbe runs `/tmp/probe args...` as user (empty: the default, root)
// and returns its "name: result" lines as a map.
func (e *env) runProbe(t *testing.T, id, user string, args ...string) map[string]string {
	t.Helper()
	r, err := e.Exec(t.Context(), &opendsecv1.ExecStart{SandboxId: id, User: user, Command: append([]string{"/tmp/probe"}, args...)})
	if err != nil {
		t.Fatalf("probe %v: %v", args, err)
	}
	if r.Exit.GetExitCode() != 0 {
		t.Fatalf("probe %v: exit %d, stdout %q stderr %q", args, r.Exit.GetExitCode(), r.Stdout, r.Stderr)
	}
	out := map[string]string{}
	for _, l := range strings.Split(strings.TrimSpace(r.Stdout), "\n") {
		k, v, ok := strings.Cut(l, ": ")
		if ok {
			out[k] = v
		}
	}
	return out
}

// sh runs a shell line in sandbox id, failing the test unless it exits 0,
// and returns its stdout.
func (e *env) sh(t *testing.T, id, line string) string {
	t.Helper()
	r := e.Shell(t, id, line)
	if r.Exit.GetExitCode() != 0 {
		t.Fatalf("%q in %s: exit %d, stdout %q stderr %q", line, id, r.Exit.GetExitCode(), r.Stdout, r.Stderr)
	}
	return r.Stdout
}

// fails runs a shell line that must exit non-zero.
func (e *env) fails(t *testing.T, id, line string) {
	t.Helper()
	if r := e.Shell(t, id, line); r.Exit.GetExitCode() == 0 {
		t.Errorf("%q in %s succeeded (stdout %q); want it refused", line, id, r.Stdout)
	}
}

// create makes a busybox sandbox that is stopped when the test ends.
func (e *env) create(t *testing.T, spec *opendsecv1.SandboxSpec) string {
	t.Helper()
	sb := e.Create(t, spec)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		e.c.StopSandbox(ctx, sb.GetId())
	})
	return sb.GetId()
}

// execAs is an ExecStart of `/bin/sh -c line` as user in sandbox id.
func execAs(id, user, line string) *opendsecv1.ExecStart {
	return &opendsecv1.ExecStart{SandboxId: id, User: user, Command: []string{"/bin/sh", "-c", line}}
}
