package vmm

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
)

// TestTable: Add refuses a second sandbox of one ID and keeps the first,
// Get of an unknown or removed ID is not found naming the backend.
func TestTable(t *testing.T) {
	var tb Table[string]
	tb.Backend = "vm"
	a, b := "a", "b"
	if !tb.Add("x", &a) || tb.Add("x", &b) {
		t.Fatal("Add: the first of an ID must go in, a second must not")
	}
	if got, err := tb.Get("x"); err != nil || got != &a {
		t.Fatalf("Get: %v, %v; want the first", got, err)
	}
	if all := tb.All(); len(all) != 1 || all[0] != &a {
		t.Fatalf("All: %v", all)
	}
	tb.Remove("x")
	_, err := tb.Get("x")
	if !errors.Is(err, errdefs.ErrNotFound) || !strings.Contains(err.Error(), `vm sandbox "x"`) || tb.Lookup("x") != nil {
		t.Fatalf("Get after Remove: %v; want not found naming the vm sandbox", err)
	}
}

// TestForkEach: all forks are made with memory and the source's freeze,
// or none: a failure deletes the ones made and names its spec.
func TestForkEach(t *testing.T) {
	var made, deleted []string
	create := func(_ context.Context, s runtime.Spec) (runtime.Handle, error) {
		if s.ID == "bad" {
			return runtime.Handle{}, errdefs.Invalid("resources", "no")
		}
		made = append(made, s.ID)
		return runtime.Handle{ID: s.ID}, nil
	}
	del := func(_ context.Context, id string) error { deleted = append(deleted, id); return nil }
	out, err := ForkEach(context.Background(), []runtime.Spec{{ID: "f1"}, {ID: "f2"}}, 3*time.Millisecond, create, del)
	if err != nil || len(out) != 2 || out[1].Handle.ID != "f2" || !out[0].MemoryPreserved || out[0].SourceFrozen != 3*time.Millisecond {
		t.Fatalf("ForkEach: %+v, %v", out, err)
	}
	made, deleted = nil, nil
	_, err = ForkEach(context.Background(), []runtime.Spec{{ID: "f1"}, {ID: "f2"}, {ID: "bad"}}, 0, create, del)
	if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), "fork bad") || !slices.Equal(deleted, made) || len(made) != 2 {
		t.Fatalf("ForkEach with a failing spec: %v, made %v, deleted %v; want the made ones deleted", err, made, deleted)
	}
}

// TestWithin: true when done closes, false when the time passes or ctx ends.
func TestWithin(t *testing.T) {
	done := make(chan struct{})
	if Within(context.Background(), done, 10*time.Millisecond) {
		t.Fatal("Within: true with done open")
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if Within(ctx, done, time.Minute) {
		t.Fatal("Within: true with ctx ended")
	}
	close(done)
	if !Within(context.Background(), done, time.Minute) {
		t.Fatal("Within: false with done closed")
	}
}
