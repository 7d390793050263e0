package netpolicy

import (
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/nftables"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/testutil"
)

// benchNFT is an nftState on a node table in a namespace of its own, with
// n sandboxes' rules installed (group commits of maxGroupCommit).
func benchNFT(b *testing.B, n int) *nftState {
	testutil.RequiresRoot(b)
	dir := b.TempDir()
	path := filepath.Join(dir, "node")
	must(b, createNetNS(path, nil))
	b.Cleanup(func() { removeNetNS(path) })
	h, err := netns.GetFromPath(path)
	must(b, err)
	b.Cleanup(func() { h.Close() })
	c, err := nftables.New(nftables.WithNetNSFd(int(h)), nftables.WithSockOptions(bigReceiveBuffer), nftables.AsLasting())
	must(b, err)
	b.Cleanup(func() { c.CloseLasting() })
	pool := netip.MustParsePrefix("10.200.0.0/16")
	st := &nftState{c: c, table: &nftables.Table{Name: TableName("bnch"), Family: nftables.TableFamilyINet}, pool: pool, dns: netip.MustParseAddr("10.200.0.1")}
	must(b, st.ensureBase())
	now := time.Now()
	for i := 0; i < n; i++ {
		must(b, st.addSandbox(benchSpec(i), now))
		if (i+1)%maxGroupCommit == 0 || i == n-1 {
			must(b, c.Flush())
		}
	}
	return st
}

// benchSpec is sandbox i: a CIDR rule, a domain rule, like a default
// rule set.
func benchSpec(i int) sandboxSpec {
	rs, err := resolve(Rules{Allow: []Rule{
		{CIDR: "198.18.1.10", Protocol: "tcp", Ports: "443"},
		{Domain: "api.example.test", Protocol: "tcp", Ports: "443"},
	}}, nil)
	if err != nil {
		panic(err)
	}
	a := netip.AddrFrom4([4]byte{10, 200, byte(2 + i/128), byte(2 * (i % 128))})
	id := fmt.Sprintf("bnch%06d", i)
	return sandboxSpec{id: id, index: i + 1, hostIf: HostIfName("bnch", id), addr: a, rules: rs, flushSets: true}
}

// BenchmarkNFTApply measures one sandbox's nft apply plus removal (one
// transaction each) on a table that already holds n sandboxes: the
// per-create nft cost and how it grows with the sandboxes of the node.
func BenchmarkNFTApply(b *testing.B) {
	for _, n := range []int{0, 1000} {
		b.Run(fmt.Sprintf("sandboxes=%d", n), func(b *testing.B) {
			st := benchNFT(b, n)
			// The next sandbox of the node: its shard holds others.
			s := benchSpec(n)
			b.ResetTimer()
			for b.Loop() {
				must(b, st.applySandbox(s, time.Now()))
				must(b, st.removeSandbox(s.id, s.index, []string{s.hostIf}, 1))
			}
		})
	}
}

// BenchmarkNetNS measures a sandbox namespace's creation and removal:
// bare, with the IPv6 sysctl written through the node's detached procfs
// (sysctl) or through /proc (sysctl-proc, as before), and with all that
// setup does inside it (IPv6 off, lo up), next to none and to 1000 other
// sandbox namespaces (a node's sandboxes: the kernel's per-namespace
// lists, and the dentries of /proc/sys that every namespace has its own
// of, grow with them).
func BenchmarkNetNS(b *testing.B) {
	testutil.RequiresRoot(b)
	for _, others := range []int{0, 1000} {
		if others > 0 {
			dir := b.TempDir()
			for i := range others {
				p := filepath.Join(dir, fmt.Sprint(i))
				// As sandboxes were set up before writeNSSysctl: each
				// one's /proc/sys/net in the host's /proc dcache.
				must(b, createNetNS(p, func() error { return writeSysctl("net/ipv6/conf/all/disable_ipv6", "1") }))
				b.Cleanup(func() { removeNetNS(p) })
			}
		}
		for _, c := range []struct {
			name  string
			setup func() error
		}{
			{"bare", nil},
			{"sysctl", func() error { return writeNSSysctl("net/ipv6/conf/all/disable_ipv6", "1") }},
			{"sandbox", sandboxNSSetup},
			{"sysctl-proc", func() error { return writeSysctl("net/ipv6/conf/all/disable_ipv6", "1") }},
		} {
			b.Run(fmt.Sprintf("others=%d/%s", others, c.name), func(b *testing.B) {
				dir := b.TempDir()
				i := 0
				for b.Loop() {
					p := filepath.Join(dir, fmt.Sprint(i))
					i++
					must(b, createNetNS(p, c.setup))
					must(b, removeNetNS(p))
				}
			})
		}
	}
}

// BenchmarkSetupConcurrent measures Manager.Setup and Teardown of a
// sandbox with a CIDR and a domain rule, 8 of them in flight (the node's
// batch creates and stops run concurrently): ns/op is wall time per
// sandbox, cpu-ns/op the process's CPU (user+system) per sandbox, which is
// what bounds a burst (the kernel's namespace cleanup runs in kworkers and
// is not in it; machine-cpu-ns/op, all of the machine's busy time, is).
func BenchmarkSetupConcurrent(b *testing.B) {
	w := newWorld(b)
	rules := Rules{Allow: []Rule{
		{CIDR: apiIP, Protocol: "tcp", Ports: "443"},
		{Domain: "api.example.test", Protocol: "tcp", Ports: "443"},
	}}
	var n atomic.Int64
	var ru0, ru1 unix.Rusage
	unix.Getrusage(unix.RUSAGE_SELF, &ru0)
	busy0 := machineBusy(b)
	b.SetParallelism(4) // GOMAXPROCS 2: 8 in flight
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			sid := fmt.Sprintf("bnchset%06d", n.Add(1))
			_, err := w.m.Setup(b.Context(), sid, rules)
			must(b, err)
			must(b, w.m.Teardown(b.Context(), sid))
		}
	})
	unix.Getrusage(unix.RUSAGE_SELF, &ru1)
	cpu := time.Duration(ru1.Utime.Nano() + ru1.Stime.Nano() - ru0.Utime.Nano() - ru0.Stime.Nano())
	b.ReportMetric(float64(cpu.Nanoseconds())/float64(b.N), "cpu-ns/op")
	b.ReportMetric(float64((machineBusy(b)-busy0).Nanoseconds())/float64(b.N), "machine-cpu-ns/op")
}

// machineBusy is the machine's busy CPU time so far (/proc/stat: all but
// idle and iowait).
func machineBusy(b *testing.B) time.Duration {
	data, err := os.ReadFile("/proc/stat")
	must(b, err)
	line, _, _ := strings.Cut(string(data), "\n")
	f := strings.Fields(line)
	var busy int64
	for i, v := range f[1:] {
		n, err := strconv.ParseInt(v, 10, 64)
		must(b, err)
		if i != 3 && i != 4 && i < 8 { // idle, iowait; guest time is in user
			busy += n
		}
	}
	return time.Duration(busy) * time.Second / 100 // USER_HZ
}
