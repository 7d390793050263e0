package placement

import (
	"errors"
	"strings"
	"testing"

	"github.com/kernflux/opendsec/internal/errdefs"
)

func node(id string, usedMem int64) Node {
	return Node{
		ID: id, Healthy: true, Backends: []string{"container"}, DefaultBackend: "container",
		Total: Resources{CPU: 8, MemoryMB: 8192, Sandboxes: 100},
		Used:  Resources{CPU: 0, MemoryMB: usedMem, Sandboxes: 0},
	}
}

func req(mem int64) Request { return Request{Backend: "container", CPU: 1, MemoryMB: mem} }

func fieldOf(err error) string {
	var fe *errdefs.FieldError
	if errors.As(err, &fe) {
		return fe.Field
	}
	return ""
}

func TestLeastLoadedWhenSamplingAll(t *testing.T) {
	p := New(3)
	nodes := []Node{node("n001", 6000), node("n002", 1000), node("n003", 3000)}
	for range 20 {
		got, err := p.Candidates(nodes, req(512))
		if err != nil {
			t.Fatal(err)
		}
		if strings.Join(got, ",") != "n002,n003,n001" {
			t.Fatalf("order = %v, want least loaded first", got)
		}
	}
}

func TestSampleKIsRandomButLeastLoadedWithin(t *testing.T) {
	p := New(2)
	nodes := []Node{node("n001", 0), node("n002", 2000), node("n003", 4000), node("n004", 6000)}
	firsts := map[string]int{}
	for range 400 {
		got, err := p.Candidates(nodes, req(512))
		if err != nil {
			t.Fatal(err)
		}
		if len(got) != 4 {
			t.Fatalf("got %v, want all 4 fitting nodes", got)
		}
		firsts[got[0]]++
		if got[0] > got[1] {
			t.Fatalf("sample %v not ordered by load", got[:2])
		}
	}
	// With k=2 the most loaded node can never be first, the least loaded
	// wins whenever sampled (1/2 of the time), the others sometimes.
	if firsts["n004"] != 0 || firsts["n001"] < 120 || firsts["n002"] == 0 || firsts["n003"] == 0 {
		t.Fatalf("first picks %v do not look like power-of-2 choices", firsts)
	}
}

func TestFilters(t *testing.T) {
	p := New(2)
	sick := node("n002", 0)
	sick.Healthy = false
	vm := node("n003", 0)
	vm.Backends = []string{"vm"}
	full := node("n004", 8000)
	got, err := p.Candidates([]Node{node("n001", 4000), sick, vm, full}, req(512))
	if err != nil {
		t.Fatal(err)
	}
	if strings.Join(got, ",") != "n001" {
		t.Fatalf("got %v, want only n001", got)
	}
}

func TestNoFit(t *testing.T) {
	p := New(2)
	nodes := []Node{node("n001", 8000), node("n002", 7900)}
	_, err := p.Candidates(nodes, req(512))
	if !errors.Is(err, errdefs.ErrResourceExhausted) || !strings.Contains(err.Error(), "memory") {
		t.Fatalf("full: err = %v, want resource exhausted naming memory", err)
	}
	if _, err := p.Candidates(nodes, req(9000)); fieldOf(err) != "memory_mb" || !strings.Contains(err.Error(), "8192") {
		t.Fatalf("too big: err = %v, want invalid memory_mb naming 8192", err)
	}
	if _, err := p.Candidates(nodes, Request{Backend: "container", CPU: 16, MemoryMB: 1}); fieldOf(err) != "cpu" {
		t.Fatalf("too many cpus: err = %v, want invalid cpu", err)
	}
	if _, err := p.Candidates(nodes, Request{Backend: "gvisor", CPU: 1, MemoryMB: 1}); fieldOf(err) != "backend" || !strings.Contains(err.Error(), "known: container") {
		t.Fatalf("unknown backend: err = %v", err)
	}
	slots := node("n001", 0)
	slots.Used.Sandboxes = 100
	if _, err := p.Candidates([]Node{slots}, req(1)); !errors.Is(err, errdefs.ErrResourceExhausted) || !strings.Contains(err.Error(), "sandbox slots") {
		t.Fatalf("no slots: err = %v", err)
	}
	sick := node("n001", 0)
	sick.Healthy = false
	if _, err := p.Candidates([]Node{sick}, req(1)); !errors.Is(err, errdefs.ErrUnavailable) {
		t.Fatalf("all unhealthy: err = %v, want unavailable", err)
	}
	if _, err := p.Candidates(nil, Request{CPU: 1, MemoryMB: 1}); !errors.Is(err, errdefs.ErrUnavailable) {
		t.Fatalf("no nodes: err = %v, want unavailable", err)
	}
}

func TestOverlay(t *testing.T) {
	p := New(2)
	nodes := []Node{node("n001", 0), node("n002", 1024)}

	// Two in-flight 2 GiB creates on n001 make it more loaded than n002.
	r1 := p.Reserve("n001", req(2048))
	r2 := p.Reserve("n001", req(2048))
	got, _ := p.Candidates(nodes, req(512))
	if got[0] != "n002" {
		t.Fatalf("with overlay got %v, want n002 first", got)
	}
	// A failed create stops counting at once.
	r1.Release()
	r2.Release()
	got, _ = p.Candidates(nodes, req(512))
	if got[0] != "n001" {
		t.Fatalf("after release got %v, want n001 first", got)
	}
	// In-flight creates that fill n001 move it behind n002, but never out.
	r3 := p.Reserve("n001", req(8000))
	if got, err := p.Candidates(nodes, req(512)); strings.Join(got, ",") != "n002,n001" {
		t.Fatalf("in-flight-full n001: got %v, %v; want n002 then n001", got, err)
	}
	r3.Release()
}

// TestSecurityPlacementReadings: a node's own reading (what a create or
// stop returned) counts from then on, in place of an older view, until a
// view at least as new replaces it; a stopped sandbox stops counting at
// once. The old overlay kept a finished create counted for a fixed hold,
// stopped or not, and refused creates against an empty cluster.
func TestSecurityPlacementReadings(t *testing.T) {
	p := New(2)
	view := node("n001", 0)
	view.UsedSeq = 100
	one := Request{Backend: "container", CPU: 8, MemoryMB: 1}

	// A create returns the node's reading with its sandbox: n001 is full.
	r := p.Reserve("n001", one)
	r.Done(Resources{CPU: 8, MemoryMB: 1, Sandboxes: 1}, 101)
	if _, err := p.Candidates([]Node{view}, one); !errors.Is(err, errdefs.ErrResourceExhausted) {
		t.Fatalf("after a create that filled the node: %v; want resource exhausted", err)
	}
	// Its stop returns the next reading: room again, the old view unchanged.
	p.Observe("n001", Resources{}, 102)
	if got, err := p.Candidates([]Node{view}, one); err != nil || strings.Join(got, ",") != "n001" {
		t.Fatalf("after the stop: %v, %v; want n001", got, err)
	}
	// A reading older than the one held is ignored.
	p.Observe("n001", Resources{CPU: 8, MemoryMB: 1, Sandboxes: 1}, 101)
	if _, err := p.Candidates([]Node{view}, one); err != nil {
		t.Fatalf("an older reading replaced a newer one: %v", err)
	}
	// A view as new as the reading replaces it.
	p.Observe("n001", Resources{CPU: 8, MemoryMB: 1, Sandboxes: 1}, 103)
	caught := view
	caught.UsedSeq = 103
	if _, err := p.Candidates([]Node{caught}, one); err != nil {
		t.Fatalf("a view at the reading's seq (empty) did not replace it: %v", err)
	}
	// Churn: a thousand creates and stops leave nothing counted.
	for i := range 1000 {
		r := p.Reserve("n001", one)
		r.Done(Resources{CPU: 8, MemoryMB: 1, Sandboxes: 1}, uint64(1000+2*i))
		p.Observe("n001", Resources{}, uint64(1001+2*i))
	}
	if got, err := p.Candidates([]Node{view}, one); err != nil || strings.Join(got, ",") != "n001" {
		t.Fatalf("after churn: %v, %v; want n001", got, err)
	}
	// In flight alone never refuses: the node decides.
	p.Reserve("n001", one)
	if got, err := p.Candidates([]Node{view}, one); err != nil || strings.Join(got, ",") != "n001" {
		t.Fatalf("with a create in flight: %v, %v; want n001", got, err)
	}
}
