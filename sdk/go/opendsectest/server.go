// Package opendsectest runs an in-process fake OpenDsec API server for
// tests of code built on the Go client and the CLI. It speaks the real wire
// protocol (gRPC and Connect over h2c on loopback) and keeps sandboxes and
// their files in memory; "processes" are a handful of built-in commands or
// a test-supplied ExecFunc. It checks bearer tokens and records every call's
// Authorization header, and can inject failures (see FailCreates).
package opendsectest

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/api/gen/opendsec/v1/opendsecv1connect"
)

// Images the fake knows; creating from any other fails with NotFound.
var Images = []string{"root/busybox", "root/py:3.11"}

// Call is one RPC the server received.
type Call struct {
	// Procedure is e.g. "/opendsec.v1.SandboxService/CreateSandbox".
	Procedure string
	// Authorization is the header as received.
	Authorization string
}

// Server is a running fake. Fields set before the first call configure it.
type Server struct {
	// URL is the base URL, e.g. "http://127.0.0.1:41234".
	URL string
	// Token is the bearer token calls must carry.
	Token string
	// Exec, when set, runs every exec instead of the built-in commands.
	Exec ExecFunc
	// MaxUploadBytes rejects WriteFile headers announcing more (0 = no cap).
	MaxUploadBytes int64
	// BatchItemError, when set, makes batch item i fail with the returned
	// error (a *connect.Error) instead of creating a sandbox.
	BatchItemError func(i int) error
	// WarmPool, when true, makes the fake act as a node whose warm pool
	// always holds a match: every create without skip_warm_pool reports
	// from_warm_pool. When false, no create does.
	WarmPool bool
	// PoolRoom, when above 0, is the most a PrewarmSandboxes holds.
	PoolRoom int

	srv *httptest.Server

	mu            sync.Mutex
	seq           int                                   // guarded by mu
	sandboxes     map[string]*opendsecv1.Sandbox        // guarded by mu
	byRequest     map[string]string                     // request_id → sandbox ID; guarded by mu
	files         map[string]map[string][]byte          // sandbox ID → path → data; guarded by mu
	dirs          map[string]map[string]bool            // sandbox ID → directory paths; guarded by mu
	calls         []Call                                // guarded by mu
	createIDs     []string                              // request IDs of every CreateSandbox; guarded by mu
	createSkips   []bool                                // skip_warm_pool of every CreateSandbox; guarded by mu
	batchIDs      []string                              // request IDs of every BatchCreateSandboxes; guarded by mu
	batchSkips    []bool                                // skip_warm_pool of every BatchCreateSandboxes; guarded by mu
	prewarms      []*opendsecv1.PrewarmSandboxesRequest // guarded by mu
	failCreates   int                                   // guarded by mu
	failCode      connect.Code                          // guarded by mu
	failAfterSave bool                                  // guarded by mu
	halfClosedGot []byte                                // what port 2 received after its half-close; guarded by mu
	writeChunks   []int                                 // data chunk sizes of the last WriteFile; guarded by mu
	resizes       []*opendsecv1.PtySize                 // guarded by mu
	execStarts    []*opendsecv1.ExecStart               // guarded by mu
	snapshots     map[string]*snapshot                  // guarded by mu
}

// New starts a fake server on loopback requiring token and stops it when
// the test ends.
func New(t testing.TB, token string) *Server {
	t.Helper()
	s := &Server{
		Token:     token,
		sandboxes: map[string]*opendsecv1.Sandbox{},
		byRequest: map[string]string{},
		files:     map[string]map[string][]byte{},
		dirs:      map[string]map[string]bool{},
		snapshots: map[string]*snapshot{},
	}
	opts := connect.WithInterceptors(authInterceptor{s: s})
	mux := http.NewServeMux()
	mux.Handle(opendsecv1connect.NewSandboxServiceHandler(sandboxService{s: s}, opts))
	mux.Handle(opendsecv1connect.NewProcessServiceHandler(processService{s: s}, opts))
	mux.Handle(opendsecv1connect.NewFileServiceHandler(fileService{s: s}, opts))
	mux.Handle(opendsecv1connect.NewPortServiceHandler(portService{s: s}, opts))
	mux.Handle(opendsecv1connect.NewSnapshotServiceHandler(snapshotService{s: s}, opts))
	s.srv = httptest.NewUnstartedServer(mux)
	var p http.Protocols
	p.SetHTTP1(true)
	p.SetUnencryptedHTTP2(true)
	s.srv.Config.Protocols = &p
	s.srv.Start()
	s.URL = s.srv.URL
	t.Cleanup(s.srv.Close)
	return s
}

// Addr returns the server's host:port.
func (s *Server) Addr() string { return strings.TrimPrefix(s.URL, "http://") }

// Close stops the server; later calls fail with Unavailable.
func (s *Server) Close() { s.srv.Close() }

// FailCreates makes the next n CreateSandbox calls fail with code. With
// afterSave the sandbox is made first and only the answer is lost, as when
// a connection drops after the server did the work.
func (s *Server) FailCreates(n int, code connect.Code, afterSave bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.failCreates, s.failCode, s.failAfterSave = n, code, afterSave
}

// Calls returns every call received so far.
func (s *Server) Calls() []Call {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]Call(nil), s.calls...)
}

// CreateRequestIDs returns the request_id of every CreateSandbox received.
func (s *Server) CreateRequestIDs() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.createIDs...)
}

// CreateSkipWarmPool returns the skip_warm_pool flag of every CreateSandbox
// received, in order.
func (s *Server) CreateSkipWarmPool() []bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]bool(nil), s.createSkips...)
}

// BatchRequestIDs returns the request_id of every BatchCreateSandboxes
// received, in order.
func (s *Server) BatchRequestIDs() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.batchIDs...)
}

// Prewarms returns every PrewarmSandboxes request received, in order.
func (s *Server) Prewarms() []*opendsecv1.PrewarmSandboxesRequest {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]*opendsecv1.PrewarmSandboxesRequest(nil), s.prewarms...)
}

// BatchSkipWarmPool returns the skip_warm_pool flag of every
// BatchCreateSandboxes received, in order.
func (s *Server) BatchSkipWarmPool() []bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]bool(nil), s.batchSkips...)
}

// WriteChunks returns the data chunk sizes of the last WriteFile.
func (s *Server) WriteChunks() []int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]int(nil), s.writeChunks...)
}

// Resizes returns every PTY resize received by exec streams.
func (s *Server) Resizes() []*opendsecv1.PtySize {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]*opendsecv1.PtySize(nil), s.resizes...)
}

// ExecStarts returns the start message of every exec.
func (s *Server) ExecStarts() []*opendsecv1.ExecStart {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]*opendsecv1.ExecStart(nil), s.execStarts...)
}

// Sandboxes returns the running sandboxes sorted by ID.
func (s *Server) Sandboxes() []*opendsecv1.Sandbox {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]*opendsecv1.Sandbox, 0, len(s.sandboxes))
	for _, sb := range s.sandboxes {
		out = append(out, proto.Clone(sb).(*opendsecv1.Sandbox))
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Id < out[j].Id })
	return out
}

// File returns a file's contents inside a sandbox.
func (s *Server) File(id, path string) ([]byte, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	b, ok := s.files[id][path]
	return append([]byte(nil), b...), ok
}

// PutFile stores a file inside a sandbox.
func (s *Server) PutFile(id, path string, data []byte) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.files[id] == nil {
		s.files[id] = map[string][]byte{}
	}
	s.files[id][path] = append([]byte(nil), data...)
}

// authInterceptor records every call and rejects wrong tokens.
type authInterceptor struct{ s *Server }

func (a authInterceptor) check(procedure string, h http.Header) error {
	got := h.Get("Authorization")
	a.s.mu.Lock()
	a.s.calls = append(a.s.calls, Call{Procedure: procedure, Authorization: got})
	a.s.mu.Unlock()
	if got == "" {
		return connect.NewError(connect.CodeUnauthenticated, fmt.Errorf("missing bearer token"))
	}
	if got != "Bearer "+a.s.Token {
		return connect.NewError(connect.CodeUnauthenticated, fmt.Errorf("token is unknown or expired"))
	}
	return nil
}

func (a authInterceptor) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		if err := a.check(req.Spec().Procedure, req.Header()); err != nil {
			return nil, err
		}
		return next(ctx, req)
	}
}

func (a authInterceptor) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

func (a authInterceptor) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return func(ctx context.Context, conn connect.StreamingHandlerConn) error {
		if err := a.check(conn.Spec().Procedure, conn.RequestHeader()); err != nil {
			return err
		}
		return next(ctx, conn)
	}
}

// sandbox returns a running sandbox or NotFound.
func (s *Server) sandbox(id string) (*opendsecv1.Sandbox, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	sb, ok := s.sandboxes[id]
	if !ok {
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("sandbox %q not found", id))
	}
	return sb, nil
}

func validateSpec(spec *opendsecv1.SandboxSpec) error {
	switch {
	case spec.GetImage() == "":
		return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("spec.image: must not be empty; e.g. root/busybox"))
	case spec.GetMemoryMb() < 0:
		return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("spec.memory_mb: must not be negative"))
	case spec.GetTimeoutSeconds() < 0:
		return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("spec.timeout_seconds: must not be negative"))
	}
	for _, im := range Images {
		if spec.GetImage() == im {
			return nil
		}
	}
	if spec.GetSnapshot() != "" && spec.GetImage() == "snapshot/"+spec.GetSnapshot() {
		return nil
	}
	return connect.NewError(connect.CodeNotFound, fmt.Errorf("image %q not found", spec.GetImage()))
}

// create makes a sandbox for requestID, or returns the one it already made.
// fromPool says whether the new sandbox is reported as taken from the warm
// pool.
func (s *Server) create(spec *opendsecv1.SandboxSpec, requestID string, fromPool bool) (*opendsecv1.Sandbox, error) {
	spec, files, err := s.fromSnapshot(spec)
	if err != nil {
		return nil, err
	}
	if err := validateSpec(spec); err != nil {
		return nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if id, ok := s.byRequest[requestID]; ok && requestID != "" {
		if sb, ok := s.sandboxes[id]; ok {
			return proto.Clone(sb).(*opendsecv1.Sandbox), nil
		}
	}
	s.seq++
	now := time.Now()
	timeout := spec.GetTimeoutSeconds()
	if timeout == 0 {
		timeout = 300
	}
	sb := &opendsecv1.Sandbox{
		Id:        fmt.Sprintf("n001sb%04d", s.seq),
		NodeId:    "n001",
		Spec:      proto.Clone(spec).(*opendsecv1.SandboxSpec),
		State:     opendsecv1.SandboxState_SANDBOX_STATE_RUNNING,
		CreatedAt: timestamppb.New(now),
		ExpiresAt: timestamppb.New(now.Add(time.Duration(timeout) * time.Second)),

		FromWarmPool: fromPool,
	}
	if sb.Spec.Backend == "" {
		sb.Spec.Backend = "container"
	}
	s.sandboxes[sb.Id] = sb
	s.byRequest[requestID] = sb.Id
	s.files[sb.Id] = map[string][]byte{}
	for p, b := range files {
		s.files[sb.Id][p] = append([]byte(nil), b...)
	}
	s.dirs[sb.Id] = map[string]bool{"/": true, "/tmp": true}
	return proto.Clone(sb).(*opendsecv1.Sandbox), nil
}

// HalfClosedPortGot returns what the fake's port 2 received after it
// half-closed (see ConnectPort), once the caller half-closed too.
func (s *Server) HalfClosedPortGot() []byte {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]byte(nil), s.halfClosedGot...)
}
