package config

import (
	"strings"
	"testing"
	"time"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/sandboxspec"
)

func TestImportDirDefaultAndValidation(t *testing.T) {
	c := Default("/var/lib/opendsec")
	if err := c.Validate(); err != nil {
		t.Fatalf("default config: %v", err)
	}
	if c.Node.ImportDir != "/var/lib/opendsec/import" {
		t.Fatalf("node.import_dir default = %q, want /var/lib/opendsec/import", c.Node.ImportDir)
	}
	for _, bad := range []string{"", "import", "/"} {
		c.Node.ImportDir = bad
		err := c.Validate()
		if !errdefs.IsInvalidArgument(err) || !strings.HasPrefix(err.Error(), "node.import_dir:") {
			t.Fatalf("node.import_dir %q: %v, want an invalid node.import_dir error", bad, err)
		}
	}
}

func TestMaxPaused(t *testing.T) {
	c := Default("/var/lib/opendsec")
	if d, err := c.Node.MaxPausedDuration(); err != nil || d != 24*time.Hour {
		t.Fatalf("node.max_paused default = %s (%v), want 24h", d, err)
	}
	c.Node.MaxPaused = "0"
	if d, err := c.Node.MaxPausedDuration(); err != nil || d != 0 {
		t.Fatalf("node.max_paused \"0\" = %s (%v), want 0 (forever)", d, err)
	}
	for _, bad := range []string{"24", "-1h", "a day"} {
		c.Node.MaxPaused = bad
		err := c.Validate()
		if !errdefs.IsInvalidArgument(err) || !strings.HasPrefix(err.Error(), "node.max_paused:") {
			t.Fatalf("node.max_paused %q: %v, want an invalid node.max_paused error", bad, err)
		}
	}
}

// TestSecurityPidsLimitConfig: the node's process and file limits default
// to 4096 per sandbox, the host's pids less headroom for all sandboxes,
// and 4096 open files; bad values name their field.
func TestSecurityPidsLimitConfig(t *testing.T) {
	c := Default("/var/lib/opendsec")
	l, err := c.Node.Limits()
	if err != nil {
		t.Fatalf("default limits: %v", err)
	}
	avail, err := sandboxspec.HostPids()
	if err != nil {
		t.Fatal(err)
	}
	if l.MaxPidsLimit != 4096 || l.NofileLimit != 4096 || l.TotalPidsLimit != sandboxspec.TotalPidsCeiling(avail) {
		t.Fatalf("default limits = %+v, want max 4096, nofile 4096, total %d", l, sandboxspec.TotalPidsCeiling(avail))
	}
	c.Node.TotalPidsLimit = 5000
	if l, err := c.Node.Limits(); err != nil || l.TotalPidsLimit != 5000 {
		t.Fatalf("total_pids_limit 5000: %+v, %v", l, err)
	}
	for _, bad := range []struct {
		field string
		mod   func(*Node)
	}{
		{"node.max_pids_limit", func(n *Node) { n.MaxPidsLimit = 100 }},
		{"node.max_pids_limit", func(n *Node) { n.MaxPidsLimit = 10_000_000 }},
		{"node.max_pids_limit", func(n *Node) { n.MaxPidsLimit, n.TotalPidsLimit = 8192, 5000 }},
		{"node.total_pids_limit", func(n *Node) { n.TotalPidsLimit = -1 }},
		{"node.total_pids_limit", func(n *Node) { n.TotalPidsLimit = avail + 1 }},
		{"node.nofile_limit", func(n *Node) { n.NofileLimit = 10 }},
		{"node.nofile_limit", func(n *Node) { n.NofileLimit = 1 << 21 }},
	} {
		c := Default("/var/lib/opendsec")
		bad.mod(&c.Node)
		err := c.Validate()
		if !errdefs.IsInvalidArgument(err) || !strings.HasPrefix(err.Error(), bad.field+":") {
			t.Errorf("%+v: %v, want an invalid %s error", c.Node, err, bad.field)
		}
	}
}

// TestOvercommitConfig: node.cpu_overcommit defaults to 16 and
// node.memory_overcommit to 1 (also when 0); out-of-range values are
// refused naming the key.
func TestOvercommitConfig(t *testing.T) {
	c := Default("/var/lib/opendsec")
	if cpu, mem, err := c.Node.Overcommit(); err != nil || cpu != 16 || mem != 1 {
		t.Fatalf("default overcommit = %g, %g, %v; want 16, 1", cpu, mem, err)
	}
	c.Node.CPUOvercommit, c.Node.MemoryOvercommit = 0, 0
	if cpu, mem, err := c.Node.Overcommit(); err != nil || cpu != 16 || mem != 1 {
		t.Fatalf("overcommit 0 = %g, %g, %v; want the defaults 16, 1", cpu, mem, err)
	}
	c.Node.CPUOvercommit, c.Node.MemoryOvercommit = 50, 6
	if cpu, mem, err := c.Node.Overcommit(); err != nil || cpu != 50 || mem != 6 {
		t.Fatalf("overcommit 50, 6 = %g, %g, %v", cpu, mem, err)
	}
	for _, bad := range []struct {
		field string
		mod   func(*Node)
	}{
		{"node.cpu_overcommit", func(n *Node) { n.CPUOvercommit = -1 }},
		{"node.cpu_overcommit", func(n *Node) { n.CPUOvercommit = 0.5 }},
		{"node.cpu_overcommit", func(n *Node) { n.CPUOvercommit = 5000 }},
		{"node.memory_overcommit", func(n *Node) { n.MemoryOvercommit = 0.9 }},
		{"node.memory_overcommit", func(n *Node) { n.MemoryOvercommit = 1000 }},
	} {
		c := Default("/var/lib/opendsec")
		bad.mod(&c.Node)
		err := c.Validate()
		if !errdefs.IsInvalidArgument(err) || !strings.HasPrefix(err.Error(), bad.field+":") {
			t.Errorf("%+v: %v, want an invalid %s error", c.Node, err, bad.field)
		}
	}
}

func TestE2BBackendConfig(t *testing.T) {
	c := Default("/var/lib/opendsec")
	for _, ok := range []string{"", "container", "microvm"} {
		c.E2B.Backend = ok
		if err := c.Validate(); err != nil {
			t.Fatalf("e2b.backend %q: %v", ok, err)
		}
	}
	c.E2B.Backend = "Container VM"
	if err := c.Validate(); !errdefs.IsInvalidArgument(err) || !strings.HasPrefix(err.Error(), "e2b.backend:") {
		t.Fatalf("e2b.backend %q: %v, want an invalid e2b.backend error", c.E2B.Backend, err)
	}
}

func TestE2BTLSConfig(t *testing.T) {
	c := Default("/var/lib/opendsec")
	c.E2B.TLS = E2BTLS{Enabled: true}
	if err := c.Validate(); err != nil {
		t.Fatalf("e2b.tls enabled without files: %v", err)
	}
	if c.E2BTLSDir() != "/var/lib/opendsec/e2b/tls" {
		t.Fatalf("E2BTLSDir = %q", c.E2BTLSDir())
	}
	for _, bad := range []E2BTLS{
		{Enabled: true, CertFile: "/etc/gw.pem"},
		{Enabled: true, KeyFile: "/etc/gw.key"},
		{Enabled: true, CertFile: "gw.pem", KeyFile: "gw.key"},
	} {
		c.E2B.TLS = bad
		if err := c.Validate(); !errdefs.IsInvalidArgument(err) || !strings.HasPrefix(err.Error(), "e2b.tls:") {
			t.Fatalf("e2b.tls %+v: %v, want an invalid e2b.tls error", bad, err)
		}
	}
	c.E2B.TLS = E2BTLS{Enabled: true, CertFile: "/etc/gw.pem", KeyFile: "/etc/gw.key"}
	if err := c.Validate(); err != nil {
		t.Fatalf("e2b.tls with both files: %v", err)
	}
}

// TestPprofListenLoopbackOnly: the unauthenticated profiling endpoint is
// off by default and accepts loopback addresses only.
func TestPprofListenLoopbackOnly(t *testing.T) {
	c := Default("/var/lib/opendsec")
	if c.Debug.PprofListen != "" {
		t.Fatalf("debug.pprof_listen defaults to %q, want off", c.Debug.PprofListen)
	}
	for _, ok := range []string{"127.0.0.1:6060", "127.0.0.2:1", "[::1]:6060"} {
		c.Debug.PprofListen = ok
		if err := c.Validate(); err != nil {
			t.Errorf("%s: %v", ok, err)
		}
	}
	for _, bad := range []string{"0.0.0.0:6060", ":6060", "localhost:6060", "10.0.0.1:6060", "[::]:6060", "127.0.0.1", "127.0.0.1:0", "127.0.0.1:http"} {
		c.Debug.PprofListen = bad
		err := c.Validate()
		if !errdefs.IsInvalidArgument(err) || !strings.HasPrefix(err.Error(), "debug.pprof_listen:") {
			t.Errorf("%q: %v, want an invalid debug.pprof_listen error", bad, err)
		}
	}
}
