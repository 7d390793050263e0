// Package placement chooses nodes for new sandboxes: filter the healthy
// nodes that offer the backend and have room, sample k of them at random and
// order the sample by load.
//
// A node's use is its latest reading: the watcher's view, or a newer one
// this apiserver got back from the node itself with a create or a stop
// (readings are ordered by the node's used_seq), so a sandbox counts from
// its create to its stop, never longer. Creates still in flight count on
// top of that for the order and the first choice of nodes; they never make
// placement refuse (the reading may already hold them), the node's own
// admission does.
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
	// Used is what its sandboxes have reserved, read at UsedSeq (the
	// node's used_seq; 0: unknown, any reading of the node's own is newer).
	Used    Resources
	UsedSeq uint64
}

// Request is what one sandbox needs. Backend "" means each node's default.
type Request struct {
	Backend  string
	CPU      float64
	MemoryMB int64
}

func (r Request) resources() Resources { return Resources{r.CPU, r.MemoryMB, 1} }

// readingTTL bounds how long a node's own reading is preferred to the
// view: it is normally superseded by the next view within a poll or two;
// this only guards against a node whose clock stepped back across a
// restart (its used_seq would then lag an old reading).
const readingTTL = time.Minute

// reading is a node's use as of its used_seq.
type reading struct {
	used Resources
	seq  uint64
	at   time.Time
}

// Placer orders candidates, keeps the creates in flight and the newest
// readings nodes returned. It is safe for concurrent use.
type Placer struct {
	k   int
	now func() time.Time

	mu sync.Mutex
	// inflight are creates under way by node ID; guarded by mu.
	inflight map[string][]*Reservation
	// readings are the newest readings of the nodes' use that came with
	// a create or stop, by node ID; guarded by mu.
	readings map[string]reading
	// rng is guarded by mu.
	rng *rand.Rand
}

// New returns a Placer sampling k nodes (at least 1).
func New(k int) *Placer {
	if k < 1 {
		k = 1
	}
	return &Placer{
		k:        k,
		now:      time.Now,
		inflight: map[string][]*Reservation{},
		readings: map[string]reading{},
		rng:      rand.New(rand.NewPCG(rand.Uint64(), rand.Uint64())),
	}
}

// Reservation is one create in flight, counted against its node until
// Done or Release.
type Reservation struct {
	p    *Placer
	node string
	res  Resources
}

// Reserve counts req against node while its create is in flight.
func (p *Placer) Reserve(node string, req Request) *Reservation {
	r := &Reservation{p: p, node: node, res: req.resources()}
	p.mu.Lock()
	p.inflight[node] = append(p.inflight[node], r)
	p.mu.Unlock()
	return r
}

// Release ends the reservation: the create failed, or it finished and
// Observe took the node's reading that includes it.
func (r *Reservation) Release() {
	r.p.mu.Lock()
	defer r.p.mu.Unlock()
	r.p.inflight[r.node] = slices.DeleteFunc(r.p.inflight[r.node], func(x *Reservation) bool { return x == r })
	if len(r.p.inflight[r.node]) == 0 {
		delete(r.p.inflight, r.node)
	}
}

// Done ends a create that succeeded: used (at seq) is the node's reading
// that the create returned, which counts the new sandbox.
func (r *Reservation) Done(used Resources, seq uint64) {
	r.p.Observe(r.node, used, seq)
	r.Release()
}

// Observe records a reading of node's use (what a create or stop
// returned); it counts until a newer one, or a view at least as new,
// replaces it. A reading without seq (0) is ignored.
func (p *Placer) Observe(node string, used Resources, seq uint64) {
	if seq == 0 {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if cur, ok := p.readings[node]; !ok || seq > cur.seq {
		p.readings[node] = reading{used: used, seq: seq, at: p.now()}
	}
}

// used returns n's newest reading, dropping the node's own one when the
// view caught up with it (or it is too old to trust). Called with mu held.
func (p *Placer) used(n Node) Resources {
	r, ok := p.readings[n.ID]
	if !ok {
		return n.Used
	}
	if r.seq <= n.UsedSeq || p.now().Sub(r.at) > readingTTL {
		delete(p.readings, n.ID)
		return n.Used
	}
	return r.used
}

// inflightFor sums node's creates in flight. Called with mu held.
func (p *Placer) inflightFor(node string) Resources {
	var sum Resources
	for _, r := range p.inflight[node] {
		sum = sum.add(r.res)
	}
	return sum
}

// Candidates returns the node IDs to try for req, best first: a random
// sample of k fitting nodes ordered by load, then the other fitting nodes
// ordered by load, then the nodes that fit only when the creates in
// flight are left out (the node's reading may already count them).
// Errors:
//   - invalid argument naming the field when no node could ever fit req
//     (backend offered nowhere; cpu or memory_mb above the largest node);
//   - unavailable when no node is healthy;
//   - resource exhausted, naming the short resource, when none has room now.
func (p *Placer) Candidates(nodes []Node, req Request) ([]string, error) {
	p.mu.Lock()
	defer p.mu.Unlock()

	type cand struct {
		id   string
		load float64
	}
	var (
		fits, fitsBare                 []cand
		withBackend, healthy           int
		maxCPU                         float64
		maxMem                         int64
		shortCPU, shortMem, shortSlots int
		bestFreeCPU                    float64
		bestFreeMem                    int64
		unlimitedCPU, unlimitedMem     bool
		backends                       []string
	)
	need := req.resources()
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
		used := p.used(n)
		withInflight := used.add(p.inflightFor(n.ID))
		if room(n.Total, withInflight, need) == (short{}) {
			fits = append(fits, cand{n.ID, load(n.Total, withInflight)})
			continue
		}
		sh := room(n.Total, used, need)
		if sh == (short{}) {
			fitsBare = append(fitsBare, cand{n.ID, load(n.Total, withInflight)})
			continue
		}
		if n.Total.CPU > 0 {
			bestFreeCPU = max(bestFreeCPU, n.Total.CPU-used.CPU)
		}
		if n.Total.MemoryMB > 0 {
			bestFreeMem = max(bestFreeMem, n.Total.MemoryMB-used.MemoryMB)
		}
		if sh.cpu {
			shortCPU++
		}
		if sh.mem {
			shortMem++
		}
		if sh.slots {
			shortSlots++
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
	case len(fits) == 0 && len(fitsBare) == 0:
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
	byLoad(fitsBare)
	out := make([]string, 0, len(fits)+len(fitsBare))
	for _, c := range append(fits, fitsBare...) {
		out = append(out, c.id)
	}
	return out, nil
}

// short says which resources a node lacks for a request.
type short struct{ cpu, mem, slots bool }

// room reports what total, with used taken, lacks for need (zero: it fits).
func room(total, used, need Resources) short {
	var s short
	if total.CPU > 0 && total.CPU-used.CPU+1e-9 < need.CPU {
		s.cpu = true
	}
	if total.MemoryMB > 0 && total.MemoryMB-used.MemoryMB < need.MemoryMB {
		s.mem = true
	}
	if total.Sandboxes > 0 && total.Sandboxes-used.Sandboxes < 1 {
		s.slots = true
	}
	return s
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
