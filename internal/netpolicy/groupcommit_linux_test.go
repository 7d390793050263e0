package netpolicy

import (
	"fmt"
	"net/netip"
	"strings"
	"testing"
	"time"
)

// TestConcurrentSetupsShareOneTransaction checks the nft group commit:
// sandboxes whose rules wait for the same nft lock are applied in one
// transaction, and each still gets its own policy.
func TestConcurrentSetupsShareOneTransaction(t *testing.T) {
	w := newWorld(t)
	ctx := t.Context()
	const n = 6
	// Hold the lock the applies wait for, so all of them queue behind it.
	w.m.nftMu.Lock()
	locked := true
	defer func() {
		if locked {
			w.m.nftMu.Unlock()
		}
	}()
	type result struct {
		i   int
		net Network
		err error
	}
	results := make(chan result, n)
	for i := range n {
		go func() {
			rules := Rules{}
			if i == 0 {
				rules = Rules{Allow: []Rule{{CIDR: apiIP, Protocol: "tcp", Ports: "443"}}}
			}
			s, err := w.m.Setup(ctx, id(t, fmt.Sprintf("g%d", i)), rules)
			results <- result{i, s, err}
		}()
	}
	eventually(t, 60*time.Second, "all setups queued for nft", func() error {
		w.m.nftQueueMu.Lock()
		defer w.m.nftQueueMu.Unlock()
		if q := len(w.m.nftQueue); q != n {
			return fmt.Errorf("%d of %d queued", q, n)
		}
		return nil
	})
	before := w.m.nftCommits.Load()
	locked = false
	w.m.nftMu.Unlock()
	nets := make([]Network, n)
	for range n {
		r := <-results
		must(t, r.err)
		nets[r.i] = r.net
	}
	if got := w.m.nftCommits.Load() - before; got != 1 {
		t.Fatalf("%d queued setups took %d nft transactions, want 1", n, got)
	}
	// Each has its own rules: only sandbox 0 may reach the API.
	allowed(t, "tcp out of the sandbox with the rule", func() error { return tcpFrom(nets[0], apiIP+":443") })
	for _, s := range nets[1:] {
		denied(t, "tcp out of "+s.ID, tcpFrom(s, apiIP+":443"))
	}
}

// TestGroupCommitFailureIsPerSandbox checks that when one sandbox's rules
// fail the shared transaction, the others are still applied and only that
// one reports the error.
func TestGroupCommitFailureIsPerSandbox(t *testing.T) {
	w := newWorld(t)
	spec := func(id, hostIf string, last byte) *nftApply {
		return &nftApply{now: time.Now(), spec: sandboxSpec{id: id, hostIf: hostIf, addr: netip.AddrFrom4([4]byte{10, 213, 0, last})}}
	}
	good1, good2 := spec(id(t, "ok1"), "odtgc1", 3), spec(id(t, "ok2"), "odtgc2", 5)
	// A chain name over the kernel's 256 bytes: the kernel refuses it.
	bad := spec(strings.Repeat("x", 300), "odtgc3", 7)
	w.m.nftMu.Lock()
	before := w.m.nftCommits.Load()
	w.m.applyBatch([]*nftApply{good1, bad, good2})
	commits := w.m.nftCommits.Load() - before
	left, err := w.m.nft.leftovers()
	w.m.nftMu.Unlock()
	must(t, err)
	if good1.err != nil || good2.err != nil {
		t.Fatalf("good sandboxes: %v, %v; want both applied", good1.err, good2.err)
	}
	if bad.err == nil || !bad.done || !good1.done || !good2.done {
		t.Fatalf("bad sandbox: err %v, done %v; want its own error, all done", bad.err, bad.done)
	}
	if commits != 4 {
		t.Errorf("%d transactions, want 4 (the shared one, then each alone)", commits)
	}
	for _, r := range []*nftApply{good1, good2} {
		if _, ok := left[r.spec.id]; !ok {
			t.Errorf("chains of %s missing after the retry: %v", r.spec.id, left)
		}
	}
	if _, ok := left[bad.spec.id]; ok {
		t.Errorf("chains of the refused sandbox are in the table")
	}
	w.m.nftMu.Lock()
	defer w.m.nftMu.Unlock()
	for _, r := range []*nftApply{good1, good2} {
		must(t, w.m.nft.removeSandbox(r.spec.id, r.spec.index, []string{r.spec.hostIf}, 0))
	}
}
