package netpolicy

import (
	"errors"
	"net/netip"
	"time"

	"github.com/google/nftables"
)

// What the DNS proxy remembers per sandbox: each (name, address) pair an
// answer admitted, with its expiry. An answer for a pair already known
// refreshes its expiry; expired pairs are pruned (on access at most once a
// second, and by a sweep every dnsSweepInterval); past
// Config.MaxDNSEntries the pairs closest to expiry are dropped, from the
// kernel's sets too. The kernel expires set elements itself (element
// timeouts), so pruning an expired pair needs no nftables work.

// dnsSweepInterval is how often every sandbox's expired pairs are pruned.
// A variable so tests can shorten it before New.
var dnsSweepInterval = 30 * time.Second

// learnedSet is a sandbox's admitted pairs: address → name → expiry.
type learnedSet struct {
	byAddr    map[netip.Addr]map[string]time.Time
	n         int
	lastPrune time.Time
}

func (l *learnedSet) len() int { return l.n }

// list returns the live pairs.
func (l *learnedSet) list(now time.Time) []learned {
	out := make([]learned, 0, l.n)
	for a, names := range l.byAddr {
		for name, exp := range names {
			if exp.After(now) {
				out = append(out, learned{name: name, addr: a, expires: exp})
			}
		}
	}
	return out
}

// prune drops expired pairs and returns how many went.
func (l *learnedSet) prune(now time.Time) int {
	l.lastPrune = now
	gone := 0
	for a, names := range l.byAddr {
		for name, exp := range names {
			if !exp.After(now) {
				delete(names, name)
				gone++
			}
		}
		if len(names) == 0 {
			delete(l.byAddr, a)
		}
	}
	l.n -= gone
	return gone
}

func (l *learnedSet) remove(name string, a netip.Addr) {
	names := l.byAddr[a]
	if _, ok := names[name]; !ok {
		return
	}
	delete(names, name)
	l.n--
	if len(names) == 0 {
		delete(l.byAddr, a)
	}
}

// oldest returns the pair closest to expiry.
func (l *learnedSet) oldest() (string, netip.Addr, bool) {
	var (
		bn  string
		ba  netip.Addr
		be  time.Time
		got bool
	)
	for a, names := range l.byAddr {
		for name, exp := range names {
			if !got || exp.Before(be) {
				bn, ba, be, got = name, a, exp, true
			}
		}
	}
	return bn, ba, got
}

func (l *learnedSet) set(name string, a netip.Addr, exp time.Time) {
	if l.byAddr == nil {
		l.byAddr = map[netip.Addr]map[string]time.Time{}
	}
	names := l.byAddr[a]
	if names == nil {
		names = map[string]time.Time{}
		l.byAddr[a] = names
	}
	if _, ok := names[name]; !ok {
		l.n++
	}
	names[name] = exp
}

// until is the latest expiry among the live names of a that r matches.
func (l *learnedSet) until(a netip.Addr, r rule, now time.Time) (time.Time, bool) {
	var best time.Time
	ok := false
	for name, exp := range l.byAddr[a] {
		if exp.After(now) && r.matches(name) && exp.After(best) {
			best, ok = exp, true
		}
	}
	return best, ok
}

// elemOp is one change to an element of a sandbox's domain set.
type elemOp struct {
	set     int
	addr    netip.Addr
	timeout time.Duration // for adds
	del     bool
}

// learn records addrs for name in sb (sb.mu held) and returns the nftables
// changes that make the kernel agree: every matching domain set holds each
// address until the latest expiry of the names that opened it there, and
// pairs evicted past the cap lose their elements unless another name keeps
// them.
func (m *Manager) learn(sb *sandbox, name string, addrs []netip.Addr, ttl time.Duration, now time.Time) []elemOp {
	ttl = max(ttl, time.Duration(m.cfg.MinTTLSeconds)*time.Second)
	ttl = min(ttl, time.Duration(m.cfg.MaxTTLSeconds)*time.Second)
	l := &sb.learned
	if now.Sub(l.lastPrune) >= time.Second || l.n >= m.cfg.MaxDNSEntries {
		m.learnedTotal.Add(-int64(l.prune(now)))
	}
	doms := domainRules(sb.rules)
	exp := now.Add(ttl)
	var ops []elemOp
	type pair struct {
		name string
		addr netip.Addr
	}
	var evicted []pair
	for _, a := range addrs {
		if _, known := l.byAddr[a][name]; !known {
			for l.n >= m.cfg.MaxDNSEntries {
				on, oa, ok := l.oldest()
				if !ok {
					break
				}
				l.remove(on, oa)
				m.learnedTotal.Add(-1)
				m.dnsEvicted.Add(1)
				evicted = append(evicted, pair{on, oa})
			}
			m.learnedTotal.Add(1)
		}
		l.set(name, a, exp)
	}
	for _, e := range evicted {
		for k, d := range doms {
			if !d.matches(e.name) {
				continue
			}
			if until, ok := l.until(e.addr, d, now); ok {
				ops = append(ops, elemOp{set: k, addr: e.addr, timeout: until.Sub(now)})
			} else {
				ops = append(ops, elemOp{set: k, addr: e.addr, del: true})
			}
		}
	}
	for k, d := range doms {
		if !d.matches(name) {
			continue
		}
		for _, a := range addrs {
			if until, ok := l.until(a, d, now); ok {
				ops = append(ops, elemOp{set: k, addr: a, timeout: until.Sub(now)})
			}
		}
	}
	return ops
}

// sweep prunes every sandbox's expired pairs.
func (m *Manager) sweep(now time.Time) {
	m.mu.Lock()
	sbs := make([]*sandbox, 0, len(m.sandboxes))
	for _, sb := range m.sandboxes {
		sbs = append(sbs, sb)
	}
	m.mu.Unlock()
	for _, sb := range sbs {
		sb.mu.Lock()
		m.learnedTotal.Add(-int64(sb.learned.prune(now)))
		sb.mu.Unlock()
	}
}

func (m *Manager) sweepLoop() {
	defer m.bg.Done()
	t := time.NewTicker(dnsSweepInterval)
	defer t.Stop()
	for {
		select {
		case <-m.stop:
			return
		case now := <-t.C:
			m.sweep(now)
		}
	}
}

// nftReq is one answer's element changes for the flusher.
type nftReq struct {
	sb    *sandbox
	id    string
	table *nftables.Table // the sandbox's shard
	gen   uint64
	ops   []elemOp
	done  chan error
}

var errClosed = errors.New("network policy manager is closed")

// maxBatch bounds the answers one netlink transaction carries.
const maxBatch = 128

// enqueue hands an answer's changes to the flusher; call it with sb.mu
// held, so changes reach the kernel in the order they were computed.
func (m *Manager) enqueue(sb *sandbox, ops []elemOp) chan error {
	done := make(chan error, 1)
	if len(ops) == 0 {
		done <- nil
		return done
	}
	select {
	case m.nftQ <- nftReq{sb: sb, id: sb.st.ID, table: m.nft.shard(sb.st.Index), gen: sb.gen.Load(), ops: ops, done: done}:
	case <-m.stop:
		done <- errClosed
	}
	return done
}

// wait waits for the flusher's answer.
func (m *Manager) wait(done chan error) error {
	select {
	case err := <-done:
		return err
	case <-m.stop:
		return errClosed
	}
}

// flushLoop applies queued element changes: whatever queued while the
// previous transaction ran goes in the next one, so concurrent answers
// share one netlink flush.
func (m *Manager) flushLoop() {
	defer m.bg.Done()
	for {
		var first nftReq
		select {
		case <-m.stop:
			return
		case first = <-m.nftQ:
		}
		batch := []nftReq{first}
	drain:
		for len(batch) < maxBatch {
			select {
			case r := <-m.nftQ:
				batch = append(batch, r)
			default:
				break drain
			}
		}
		m.flushBatch(batch)
	}
}

func (m *Manager) flushBatch(batch []nftReq) {
	m.nftMu.Lock()
	defer m.nftMu.Unlock()
	// A sandbox whose rules changed (or that was torn down) since the
	// request was made has had its sets rebuilt from what it learned; its
	// old set numbers mean nothing now.
	live := batch[:0:0]
	for _, r := range batch {
		if r.sb.gen.Load() != r.gen {
			r.done <- nil
			continue
		}
		live = append(live, r)
	}
	if len(live) == 0 {
		return
	}
	m.nftFlushes.Add(1)
	err := m.nft.elements(live)
	if err == nil || len(live) == 1 {
		for _, r := range live {
			r.done <- err
		}
		return
	}
	// One bad request fails the whole transaction: redo them one by one.
	for _, r := range live {
		m.nftFlushes.Add(1)
		r.done <- m.nft.elements([]nftReq{r})
	}
}

// elements applies the requests' element changes in one transaction.
func (n *nftState) elements(reqs []nftReq) error {
	for _, r := range reqs {
		for _, op := range r.ops {
			ds := dsetIn(r.table, domainSet(r.id, op.set))
			b := op.addr.As4()
			el := []nftables.SetElement{{Key: b[:]}}
			if op.del {
				// Adding first makes the delete valid when it is gone.
				if err := n.c.SetAddElements(ds, el); err != nil {
					return err
				}
				if err := n.c.SetDeleteElements(ds, el); err != nil {
					return err
				}
				continue
			}
			el[0].Timeout = max(op.timeout.Truncate(time.Millisecond), time.Millisecond)
			// Delete then add refreshes the timeout of an element that
			// exists; adding it first makes the delete valid when not.
			if err := n.c.SetAddElements(ds, el); err != nil {
				return err
			}
			if err := n.c.SetDeleteElements(ds, el); err != nil {
				return err
			}
			if err := n.c.SetAddElements(ds, el); err != nil {
				return err
			}
		}
	}
	return n.flush()
}

// bucket is a token bucket; callers serialise (sandbox.mu).
type bucket struct {
	tokens float64
	last   time.Time
}

func (b *bucket) allow(now time.Time, rate float64, burst int) bool {
	if b.last.IsZero() {
		b.tokens = float64(burst)
	} else if d := now.Sub(b.last); d > 0 {
		b.tokens = min(float64(burst), b.tokens+d.Seconds()*rate)
	}
	b.last = now
	if b.tokens < 1 {
		return false
	}
	b.tokens--
	return true
}
