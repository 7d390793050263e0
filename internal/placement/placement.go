// Package placement chooses nodes for new sandboxes: filter the healthy
// nodes that offer the backend and have room, sample k of them at random and
// order the sample by load, counting this apiserver's own in-flight
// placements that the watcher has not reported yet (the overlay).
//
// It is pure logic over a snapshot of the watcher's view; the caller tries
// the returned candidates in order, moving on when a node refuses.
package placement

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/sandboxspec"
)

// Resources are amounts of CPU (cores), memory (MiB) and sandbox slots.
type Resources struct {
	CPU       float64
	MemoryMB  int64
	Sandboxes int64
}

func (r Resources) add(o Resources) Resources {
	return Resources{r.CPU + o.CPU, r.MemoryMB + o.MemoryMB, r.Sandboxes + o.Sandboxes}
}

// Node is one candidate as the watcher sees it.
type Node struct {
	ID             string
	Healthy        bool
	Backends       []string
	DefaultBackend string
	// Total is what the node offers; a zero field means unlimited.
	Total Resources
	// Used is what its sandboxes have reserved.
	Used Resources
}

// Request is what one sandbox needs. Backend "" means each node's default.
type Request struct {
	Backend  string
	CPU      float64
	MemoryMB int64
}

func (r Request) resources() Resources { return Resources{r.CPU, r.MemoryMB, 1} }

// Placer orders candidates and keeps the in-flight overlay. It is safe for
// concurrent use.
type Placer struct {
	k    int
	hold time.Duration
	now  func() time.Time

	mu sync.Mutex
	// inflight are reservations by node ID; guarded by mu.
	inflight map[string][]*Reservation
	// rng is guarded by mu.
	rng *rand.Rand
}

// New returns a Placer sampling k nodes (at least 1). Successful
// reservations stay counted for hold after Done (set it to about two
// watcher poll intervals, so the watcher's view includes the sandbox by
// then).
func New(k int, hold time.Duration) *Placer {
	if k < 1 {
		k = 1
	}
	return &Placer{
		k:        k,
		hold:     hold,
		now:      time.Now,
		inflight: map[string][]*Reservation{},
		rng:      rand.New(rand.NewPCG(rand.Uint64(), rand.Uint64())),
	}
}

// Reservation is one in-flight placement counted against a node.
type Reservation struct {
	p      *Placer
	node   string
	res    Resources
	expiry time.Time // zero while in flight; guarded by p.mu
}

// Reserve counts req against node until Release, or until hold after Done.
func (p *Placer) Reserve(node string, req Request) *Reservation {
	r := &Reservation{p: p, node: node, res: req.resources()}
	p.mu.Lock()
	p.inflight[node] = append(p.inflight[node], r)
	p.mu.Unlock()
	return r
}

// Release drops the reservation at once (the create failed).
func (r *Reservation) Release() {
	r.p.mu.Lock()
	defer r.p.mu.Unlock()
	r.p.inflight[r.node] = slices.DeleteFunc(r.p.inflight[r.node], func(x *Reservation) bool { return x == r })
	if len(r.p.inflight[r.node]) == 0 {
		delete(r.p.inflight, r.node)
	}
}

// Done marks the create as finished: the reservation keeps counting until
// the watcher has had time to see the sandbox.
func (r *Reservation) Done() {
	r.p.mu.Lock()
	r.expiry = r.p.now().Add(r.p.hold)
	r.p.mu.Unlock()
}

// overlay returns the in-flight resources per node, pruning expired
// reservations. Called with mu held.
func (p *Placer) overlay() map[string]Resources {
	now := p.now()
	out := make(map[string]Resources, len(p.inflight))
	for node, rs := range p.inflight {
		rs = slices.DeleteFunc(rs, func(r *Reservation) bool { return !r.expiry.IsZero() && !now.Before(r.expiry) })
		if len(rs) == 0 {
			delete(p.inflight, node)
			continue
		}
		p.inflight[node] = rs
		var sum Resources
		for _, r := range rs {
			sum = sum.add(r.res)
		}
		out[node] = sum
	}
	return out
}

// Candidates returns the node IDs to try for req, best first: a random
// sample of k fitting nodes ordered by load, then the other fitting nodes
// ordered by load. Errors:
//   - invalid argument naming the field when no node could ever fit req
//     (backend offered nowhere; cpu or memory_mb above the largest node);
//   - unavailable when no node is healthy;
//   - resource exhausted, naming the short resource, when none has room now.
func (p *Placer) Candidates(nodes []Node, req Request) ([]string, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	over := p.overlay()

	type cand struct {
		id   string
		load float64
	}
	var (
		fits                           []cand
		withBackend, healthy           int
		maxCPU                         float64
		maxMem                         int64
		shortCPU, shortMem, shortSlots int
		bestFreeCPU                    float64
		bestFreeMem                    int64
		unlimitedCPU, unlimitedMem     bool
		backends                       []string
	)
	for _, n := range nodes {
		backends = append(backends, n.Backends...)
		if !offers(n, req.Backend) {
			continue
		}
		withBackend++
		if n.Total.CPU <= 0 {
			unlimitedCPU = true
		}
		if n.Total.MemoryMB <= 0 {
			unlimitedMem = true
		}
		maxCPU = max(maxCPU, n.Total.CPU)
		maxMem = max(maxMem, n.Total.MemoryMB)
		if !n.Healthy {
			continue
		}
		healthy++
		used := n.Used.add(over[n.ID])
		need := req.resources()
		ok := true
		if n.Total.CPU > 0 {
			free := n.Total.CPU - used.CPU
			bestFreeCPU = max(bestFreeCPU, free)
			if free+1e-9 < need.CPU {
				shortCPU++
				ok = false
			}
		}
		if n.Total.MemoryMB > 0 {
			free := n.Total.MemoryMB - used.MemoryMB
			bestFreeMem = max(bestFreeMem, free)
			if free < need.MemoryMB {
				shortMem++
				ok = false
			}
		}
		if n.Total.Sandboxes > 0 && n.Total.Sandboxes-used.Sandboxes < 1 {
			shortSlots++
			ok = false
		}
		if ok {
			fits = append(fits, cand{n.ID, load(n.Total, used)})
		}
	}

	switch {
	case withBackend == 0 && req.Backend != "":
		slices.Sort(backends)
		known := strings.Join(slices.Compact(backends), ", ")
		if known == "" {
			known = "none (no node reported yet)"
		}
		return nil, errdefs.Invalid("backend", "%q is not offered by any node; known: %s", req.Backend, known)
	case withBackend == 0:
		return nil, errdefs.New(errdefs.ErrUnavailable, "no node is known yet; check that nodes are running and the watcher can reach them")
	}
	// What no node with the backend could ever run: the largest one's size
	// (0 in Limits: some node has no limit).
	largest := sandboxspec.Limits{Where: "the largest node"}
	if !unlimitedMem {
		largest.MaxMemoryMB = maxMem
	}
	if !unlimitedCPU {
		largest.MaxCPU = maxCPU
	}
	if err := sandboxspec.CheckFits(sandboxspec.Spec{CPU: req.CPU, MemoryMB: req.MemoryMB}, largest); err != nil {
		return nil, err
	}
	switch {
	case healthy == 0:
		return nil, errdefs.New(errdefs.ErrUnavailable, "no healthy node offers backend %q (%d known, all unhealthy); check `opendsecctl node list`", backendName(req.Backend), withBackend)
	case len(fits) == 0:
		var short []string
		if shortMem > 0 {
			short = append(short, fmt.Sprintf("memory (need %d MiB, most free on a node %d MiB)", req.MemoryMB, bestFreeMem))
		}
		if shortCPU > 0 {
			short = append(short, fmt.Sprintf("cpu (need %g cores, most free on a node %g)", req.CPU, bestFreeCPU))
		}
		if shortSlots > 0 {
			short = append(short, fmt.Sprintf("sandbox slots (%d nodes full)", shortSlots))
		}
		return nil, errdefs.New(errdefs.ErrResourceExhausted, "no node has room: short of %s; stop sandboxes or retry later", strings.Join(short, ", "))
	}

	p.rng.Shuffle(len(fits), func(i, j int) { fits[i], fits[j] = fits[j], fits[i] })
	k := min(p.k, len(fits))
	byLoad := func(c []cand) {
		sort.SliceStable(c, func(i, j int) bool { return c[i].load < c[j].load })
	}
	byLoad(fits[:k])
	byLoad(fits[k:])
	out := make([]string, len(fits))
	for i, c := range fits {
		out[i] = c.id
	}
	return out, nil
}

func backendName(b string) string {
	if b == "" {
		return "default"
	}
	return b
}

func offers(n Node, backend string) bool {
	if backend == "" {
		return n.DefaultBackend != "" || len(n.Backends) > 0
	}
	return slices.Contains(n.Backends, backend)
}

// load is the largest used fraction of any limited resource.
func load(total, used Resources) float64 {
	var l float64
	if total.CPU > 0 {
		l = max(l, used.CPU/total.CPU)
	}
	if total.MemoryMB > 0 {
		l = max(l, float64(used.MemoryMB)/float64(total.MemoryMB))
	}
	if total.Sandboxes > 0 {
		l = max(l, float64(used.Sandboxes)/float64(total.Sandboxes))
	}
	return l
}
