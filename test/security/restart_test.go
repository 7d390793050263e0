//go:build linux

package security

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	opendsec "github.com/kernflux/opendsec/sdk/go"
	"github.com/kernflux/opendsec/test/harness"
)

// TestSecurityRestartUnderLoad: held in the red-team pass — `kill -9` of
// the whole system (`opendsec up`) while clients create sandboxes and run
// commands loses nothing. Clients retry across the outage with the same
// request IDs; afterwards every sandbox a client was given exists once,
// keeps what was written in it before the kill and answers, and no other
// sandbox appeared. Kept small (5 clients, 1 restart); the red-team ran 20
// clients and 3 restarts. Related: test/e2e TestKillNineRecovery (10 idle
// sandboxes across a kill -9).
func TestSecurityRestartUnderLoad(t *testing.T) {
	s := harness.New(t)
	s.Start()
	c := s.Client(t)
	const clients, perClient = 5, 3
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
	defer cancel()

	// retry calls fn until it succeeds or ctx ends (the outage).
	retry := func(fn func() error) error {
		for {
			err := fn()
			if err == nil || ctx.Err() != nil {
				return err
			}
			select {
			case <-ctx.Done():
				return err
			case <-time.After(100 * time.Millisecond): // retrying across the outage
			}
		}
	}
	var (
		mu      sync.Mutex
		ids     = map[string]string{} // sandbox ID -> request ID
		firstOf sync.WaitGroup        // every client has one sandbox
		wg      sync.WaitGroup
		errs    = make(chan error, clients*perClient)
	)
	firstOf.Add(clients)
	for ci := range clients {
		wg.Go(func() {
			for i := range perClient {
				reqID := fmt.Sprintf("restart-c%d-%d", ci, i)
				var sb *opendsec.Sandbox
				err := retry(func() (err error) {
					sb, err = c.CreateSandboxWithRequestID(ctx, &opendsecv1.SandboxSpec{Image: "root/busybox", Labels: map[string]string{"test": "restart"}}, reqID)
					return err
				})
				if err == nil {
					err = retry(func() error {
						r, err := c.RunShell(ctx, sb.GetId(), "echo "+reqID+" > /tmp/marker")
						if err == nil && r.ExitCode != 0 {
							err = fmt.Errorf("exit %d: %s", r.ExitCode, r.Stderr)
						}
						return err
					})
				}
				if err != nil {
					errs <- fmt.Errorf("client %d, sandbox %d: %w", ci, i, err)
				} else {
					mu.Lock()
					if prev, dup := ids[sb.GetId()]; dup {
						errs <- fmt.Errorf("request %s was given sandbox %s of request %s", reqID, sb.GetId(), prev)
					}
					ids[sb.GetId()] = reqID
					mu.Unlock()
				}
				if i == 0 {
					firstOf.Done()
				}
			}
		})
	}
	firstOf.Wait()
	s.Kill9()
	s.Start()
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if t.Failed() {
		return
	}
	l, err := c.ListSandboxes(ctx, opendsec.ListFilter{Labels: map[string]string{"test": "restart"}})
	if err != nil {
		t.Fatal(err)
	}
	if len(l) != clients*perClient || len(ids) != clients*perClient {
		t.Errorf("after the restart: %d sandboxes listed, %d given to clients; want %d", len(l), len(ids), clients*perClient)
	}
	for _, sb := range l {
		want, ok := ids[sb.GetId()]
		if !ok {
			t.Errorf("sandbox %s is listed but no client was given it", sb.GetId())
			continue
		}
		r, err := c.RunShell(ctx, sb.GetId(), "cat /tmp/marker")
		if err != nil || r.Stdout != want+"\n" {
			t.Errorf("sandbox %s (%s) after the restart: %+v %v", sb.GetId(), want, r, err)
		}
		delete(ids, sb.GetId())
	}
	for id, req := range ids {
		t.Errorf("sandbox %s (request %s) was lost", id, req)
	}
	for _, sb := range l {
		c.StopSandbox(ctx, sb.GetId())
	}
}
