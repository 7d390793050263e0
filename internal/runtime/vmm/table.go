package vmm

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
)

// Table is a backend's sandboxes by ID. The zero value is an empty table
// whose errors name no backend; set Backend.
type Table[S any] struct {
	Backend string // "vm", "microvm": names the sandbox in errors

	mu sync.Mutex
	m  map[string]*S
}

// Get is sandbox id, or errdefs.ErrNotFound.
func (t *Table[S]) Get(id string) (*S, error) {
	if s := t.Lookup(id); s != nil {
		return s, nil
	}
	return nil, errdefs.New(errdefs.ErrNotFound, "%s sandbox %q", t.Backend, id)
}

// Lookup is sandbox id, nil when the table has none.
func (t *Table[S]) Lookup(id string) *S {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.m[id]
}

// Add puts s in as sandbox id unless the table has one of that ID (then
// it says false and changes nothing).
func (t *Table[S]) Add(id string, s *S) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.m[id] != nil {
		return false
	}
	if t.m == nil {
		t.m = map[string]*S{}
	}
	t.m[id] = s
	return true
}

// Remove takes sandbox id out.
func (t *Table[S]) Remove(id string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	delete(t.m, id)
}

// All is every sandbox in the table, in no order.
func (t *Table[S]) All() []*S {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make([]*S, 0, len(t.m))
	for _, s := range t.m {
		out = append(out, s)
	}
	return out
}

// ForkEach makes one sandbox per spec with create (a restore of the
// source's snapshot), each a fork with memory whose source was frozen
// for frozen. Either all are made or none: when one fails, the ones made
// are deleted again (del) and the error names its spec.
func ForkEach(ctx context.Context, specs []runtime.Spec, frozen time.Duration,
	create func(context.Context, runtime.Spec) (runtime.Handle, error), del func(context.Context, string) error) ([]runtime.ForkResult, error) {
	out := make([]runtime.ForkResult, 0, len(specs))
	for _, s := range specs {
		h, err := create(ctx, s)
		if err != nil {
			for _, f := range out {
				_ = del(context.WithoutCancel(ctx), f.Handle.ID)
			}
			return nil, fmt.Errorf("fork %s: %w", s.ID, err)
		}
		out = append(out, runtime.ForkResult{Handle: h, MemoryPreserved: true, SourceFrozen: frozen})
	}
	return out, nil
}

// Within says whether done is closed within d; false when ctx ends first.
func Within(ctx context.Context, done <-chan struct{}, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-done:
		return true
	case <-t.C:
		return false
	case <-ctx.Done():
		return false
	}
}
