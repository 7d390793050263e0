//go:build linux

package security

import (
	"sync"
	"sync/atomic"
	"testing"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	opendsec "github.com/kernflux/opendsec/sdk/go"
	"google.golang.org/protobuf/proto"
)

// Finding 7: 20 workers at 1 CPU each against 32 CPU of capacity got
// thousands of "short of cpu" refusals although real use stayed far below.
// Here workers creating and stopping 1-CPU sandboxes never hold more than
// half the node, so nothing may be refused; at capacity a create is
// refused, and one stop later the next is admitted at once. Package tests:
// internal/apiserver TestSecurityPlacement*, internal/node
// TestSecurityPlacementNodeAdmitsItsQuota, internal/placement
// TestSecurityPlacementReadings.
func checkPlacementChurn(t *testing.T, e *env) {
	ctx := t.Context()
	if l, err := e.c.ListSandboxes(ctx, opendsec.ListFilter{}); err != nil || len(l) != 0 {
		t.Fatalf("placement needs an empty node: %d sandboxes (%v); an earlier check left some (run checks that kill sandboxes after this one)", len(l), err)
	}
	oneCPU := func() *opendsecv1.SandboxSpec {
		return &opendsecv1.SandboxSpec{Image: "root/busybox", Cpu: 1, MemoryMb: proto.Int64(64)}
	}
	const workers, rounds = sharedCPU / 2, 3
	var refused atomic.Int64
	var firstErr error
	var once sync.Once
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for range rounds {
				sb, err := e.c.CreateSandbox(ctx, oneCPU())
				if err != nil {
					if opendsec.IsResourceExhausted(err) {
						refused.Add(1)
					}
					once.Do(func() { firstErr = err })
					continue
				}
				if err := e.c.StopSandbox(ctx, sb.GetId()); err != nil {
					once.Do(func() { firstErr = err })
					return
				}
			}
		})
	}
	wg.Wait()
	if firstErr != nil {
		t.Fatalf("%d of %d creates refused with at most %d of %d CPU in use; first error: %v",
			refused.Load(), workers*rounds, workers, sharedCPU, firstErr)
	}

	// At capacity: refused; after one stop: admitted.
	var ids []string
	defer func() {
		for _, id := range ids {
			e.c.StopSandbox(ctx, id)
		}
	}()
	for i := range sharedCPU {
		sb, err := e.c.CreateSandbox(ctx, oneCPU())
		if err != nil {
			t.Fatalf("create %d of %d 1-CPU sandboxes: %v", i+1, sharedCPU, err)
		}
		ids = append(ids, sb.GetId())
	}
	if _, err := e.c.CreateSandbox(ctx, oneCPU()); !opendsec.IsResourceExhausted(err) {
		t.Fatalf("create past %d CPU: %v, want resource_exhausted", sharedCPU, err)
	}
	if err := e.c.StopSandbox(ctx, ids[0]); err != nil {
		t.Fatal(err)
	}
	ids = ids[1:]
	sb, err := e.c.CreateSandbox(ctx, oneCPU())
	if err != nil {
		t.Fatalf("create after a stop at capacity: %v", err)
	}
	ids = append(ids, sb.GetId())
}
