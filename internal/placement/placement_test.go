package placement

import (
	"errors"
	"strings"
	"testing"
	"time"

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
	p := New(3, time.Second)
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
	p := New(2, time.Second)
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
	p := New(2, time.Second)
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
	p := New(2, time.Second)
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
	p := New(2, 2*time.Second)
	now := time.Unix(1000, 0)
	p.now = func() time.Time { return now }
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
	// A finished create counts until the hold elapses.
	r3 := p.Reserve("n001", req(4096))
	r3.Done()
	got, _ = p.Candidates(nodes, req(512))
	if got[0] != "n002" {
		t.Fatalf("during hold got %v, want n002 first", got)
	}
	now = now.Add(2 * time.Second)
	got, _ = p.Candidates(nodes, req(512))
	if got[0] != "n001" {
		t.Fatalf("after hold got %v, want n001 first", got)
	}
	// The overlay also makes a node full.
	p.Reserve("n001", req(8000))
	if got, _ := p.Candidates(nodes, req(512)); strings.Join(got, ",") != "n002" {
		t.Fatalf("overlay-full n001 still offered: %v", got)
	}
}
