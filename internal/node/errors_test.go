package node

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"net/http/httptest"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	nodev1 "github.com/kernflux/opendsec/api/gen/opendsec/node/v1"
	"github.com/kernflux/opendsec/api/gen/opendsec/node/v1/nodev1connect"
	"github.com/kernflux/opendsec/internal/log"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/sandboxid"
)

// leakyDelete is a backend whose Delete fails with host paths in its error,
// as a real one's do (cgroup and state directories).
type leakyDelete struct{ blockingRuntime }

const leakedPath = "/sys/fs/cgroup/opendsec/t001xyz/cgroup.procs"

func (r *leakyDelete) Delete(context.Context, string) error {
	return fmt.Errorf("remove cgroup %s under /var/lib/opendsec/sandboxes: device or resource busy", leakedPath)
}

// A backend failure reaches the caller without the host paths in it; the
// node's log has them.
func TestAnswersCarryNoHostPaths(t *testing.T) {
	var logs bytes.Buffer
	logger := slog.New(slog.NewTextHandler(&logs, nil)) //nolint:forbidigo // a test captures the log
	now := time.Now().UTC()
	rec := &record{ID: sandboxid.New("t001"), Backend: "fake", State: stateRunning,
		Spec:      specRecord{Backend: "fake", TimeoutSec: 3600},
		CreatedAt: now, ExpiresAt: now.Add(time.Hour), StateDir: filepath.Join(t.TempDir(), "sb")}
	n := openRecorded(t, &leakyDelete{blockingRuntime{stopping: map[string]int{}, stops: map[string]int{}}}, rec)
	srv := httptest.NewServer(n.Handler(connect.WithInterceptors(logTo(logger))))
	t.Cleanup(srv.Close)
	c := nodev1connect.NewNodeServiceClient(srv.Client(), srv.URL)

	_, err := c.StopSandbox(t.Context(), connect.NewRequest(&nodev1.StopSandboxRequest{SandboxId: rec.ID}))
	if err == nil {
		t.Fatal("stop succeeded; want the backend's failure")
	}
	msg := connect.CodeOf(err).String() + ": " + err.Error()
	if p := regexp.MustCompile(`(^|[\s:"'(])/(sys|var|run|proc|tmp|etc)/`).FindString(msg); p != "" {
		t.Fatalf("answer %q carries a host path", msg)
	}
	if !strings.Contains(msg, "internal error (ref ") {
		t.Fatalf("answer %q: want the generic internal error with a reference", msg)
	}
	ref := regexp.MustCompile(`ref ([0-9a-f]{8})`).FindStringSubmatch(msg)
	if !strings.Contains(logs.String(), leakedPath) || ref == nil || !strings.Contains(logs.String(), ref[1]) {
		t.Fatalf("the log must have the detail and the reference; log:\n%s", logs.String())
	}
}

// logTo puts logger in every request's context (as the daemon's middleware
// does with the process's logger).
func logTo(l *slog.Logger) connect.Interceptor {
	return connect.UnaryInterceptorFunc(func(next connect.UnaryFunc) connect.UnaryFunc {
		return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
			return next(log.WithLogger(ctx, l), req)
		}
	})
}

var _ runtime.Runtime = (*leakyDelete)(nil)
