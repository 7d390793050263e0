package apiserver_test

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"path"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/kernflux/opendsec/api/gen/filesystem"
	"github.com/kernflux/opendsec/api/gen/filesystem/filesystemconnect"
	nodev1 "github.com/kernflux/opendsec/api/gen/opendsec/node/v1"
	"github.com/kernflux/opendsec/api/gen/opendsec/node/v1/nodev1connect"
	"github.com/kernflux/opendsec/api/gen/process"
	"github.com/kernflux/opendsec/api/gen/process/processconnect"
	"github.com/kernflux/opendsec/internal/auth"
	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/sandboxid"
)

// fakeNode is an in-process node: a NodeService keeping sandboxes in
// memory, and at /agent/<id>/ a fake envd agent (process + filesystem
// handlers, /files, and the port tunnel). It is for testing the apiserver's
// logic above the transport; the real node is tested end to end elsewhere.
type fakeNode struct {
	nodev1connect.UnimplementedNodeServiceHandler
	id  string
	url string

	mu        sync.Mutex
	sbs       map[string]*nodev1.Sandbox
	byRequest map[string]string
	creates   int // CreateSandbox calls
	specs     []*nodev1.SandboxSpec
	refuse    bool     // answer resource_exhausted
	maxSbs    int64    // admission cap
	images    []string // known images
	agent     *fakeAgent
	snaps     map[string]*nodev1.Snapshot // NodeSnapshotService's records
	// reclaimDelay holds a pause with reclaim this long (or until its
	// context ends).
	reclaimDelay time.Duration
	// poolRoom is how many sandboxes a prewarm may hold (its pool bound
	// is twice that); prewarms records each one's count.
	poolRoom int32
	prewarms []int32
}

func (n *fakeNode) PrewarmSandboxes(_ context.Context, req *connect.Request[nodev1.PrewarmSandboxesRequest]) (*connect.Response[nodev1.PrewarmSandboxesResponse], error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	m := req.Msg
	if m.GetCount() < 1 || m.GetCount() > 2*n.poolRoom {
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("count: %d must be between 1 and %d (node.warm_pool.max_sandboxes of node %s)", m.GetCount(), 2*n.poolRoom, n.id))
	}
	if !slices.Contains(n.images, m.GetSpec().GetImage()) {
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("image: %q not found", m.GetSpec().GetImage()))
	}
	n.prewarms = append(n.prewarms, m.GetCount())
	held, reason := min(m.GetCount(), n.poolRoom), ""
	if held < m.GetCount() {
		reason = fmt.Sprintf("capacity: node %s has room for %d more sandboxes", n.id, held)
	}
	return connect.NewResponse(&nodev1.PrewarmSandboxesResponse{Held: held, Ready: held, Reason: reason, TtlSeconds: max(m.GetTtlSeconds(), 600)}), nil
}

func newFakeNode(t testing.TB, key *auth.Issuer, id string) *fakeNode {
	t.Helper()
	n := &fakeNode{id: id, sbs: map[string]*nodev1.Sandbox{}, byRequest: map[string]string{}, maxSbs: 100,
		images: []string{"root/busybox", "root/py:3.11"}, agent: newFakeAgent(), snaps: map[string]*nodev1.Snapshot{}, poolRoom: 8}
	v := auth.NewVerifier(key.PublicKey(), auth.ScopeNode)
	mux := http.NewServeMux()
	mux.Handle(nodev1connect.NewNodeServiceHandler(n, connect.WithInterceptors(v.Interceptor())))
	mux.Handle(nodev1connect.NewNodeSnapshotServiceHandler(fakeSnaps{n}, connect.WithInterceptors(v.Interceptor())))
	mux.Handle("/agent/", v.Middleware(http.HandlerFunc(n.serveAgent)))
	srv := httptest.NewUnstartedServer(mux)
	srv.Config.Protocols = new(http.Protocols)
	srv.Config.Protocols.SetHTTP1(true)
	srv.Config.Protocols.SetUnencryptedHTTP2(true)
	srv.Start()
	t.Cleanup(srv.Close)
	n.url = srv.URL
	return n
}

func (n *fakeNode) set(fn func(n *fakeNode)) {
	n.mu.Lock()
	defer n.mu.Unlock()
	fn(n)
}

func (n *fakeNode) count() (creates, live int) {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.creates, len(n.sbs)
}

func (n *fakeNode) CreateSandbox(_ context.Context, req *connect.Request[nodev1.CreateSandboxRequest]) (*connect.Response[nodev1.CreateSandboxResponse], error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.creates++
	m := req.Msg
	if !strings.HasPrefix(m.GetSandboxId(), n.id) {
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("sandbox_id %q is not for node %s", m.GetSandboxId(), n.id))
	}
	if id, ok := n.byRequest[m.GetRequestId()]; ok && m.GetRequestId() != "" {
		return connect.NewResponse(&nodev1.CreateSandboxResponse{Sandbox: n.sbs[id]}), nil
	}
	if n.refuse || int64(len(n.sbs)) >= n.maxSbs {
		return nil, connect.NewError(connect.CodeResourceExhausted, errors.New("node is full"))
	}
	if !slices.Contains(n.images, m.GetSpec().GetImage()) {
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("image: %q not found; list images with `opendsecctl image list`", m.GetSpec().GetImage()))
	}
	n.specs = append(n.specs, m.GetSpec())
	sb := &nodev1.Sandbox{Id: m.GetSandboxId(), NodeId: n.id, Spec: m.GetSpec(), State: nodev1.SandboxState_SANDBOX_STATE_RUNNING, CreatedAt: timestamppb.Now(), Backend: "container"}
	n.sbs[sb.Id] = sb
	if m.GetRequestId() != "" {
		n.byRequest[m.GetRequestId()] = sb.Id
	}
	return connect.NewResponse(&nodev1.CreateSandboxResponse{Sandbox: sb}), nil
}

func (n *fakeNode) get(id string) (*nodev1.Sandbox, error) {
	sb, ok := n.sbs[id]
	if !ok {
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("sandbox %s not found", id))
	}
	return sb, nil
}

func (n *fakeNode) GetSandbox(_ context.Context, req *connect.Request[nodev1.GetSandboxRequest]) (*connect.Response[nodev1.GetSandboxResponse], error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	sb, err := n.get(req.Msg.GetSandboxId())
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&nodev1.GetSandboxResponse{Sandbox: sb}), nil
}

func (n *fakeNode) StopSandbox(_ context.Context, req *connect.Request[nodev1.StopSandboxRequest]) (*connect.Response[nodev1.StopSandboxResponse], error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if _, err := n.get(req.Msg.GetSandboxId()); err != nil {
		return nil, err
	}
	delete(n.sbs, req.Msg.GetSandboxId())
	return connect.NewResponse(&nodev1.StopSandboxResponse{}), nil
}

func (n *fakeNode) SetTimeout(_ context.Context, req *connect.Request[nodev1.SetTimeoutRequest]) (*connect.Response[nodev1.SetTimeoutResponse], error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	sb, err := n.get(req.Msg.GetSandboxId())
	if err != nil {
		return nil, err
	}
	sb.ExpiresAt = timestamppb.New(time.Now().Add(time.Duration(req.Msg.GetTimeoutSeconds()) * time.Second))
	return connect.NewResponse(&nodev1.SetTimeoutResponse{Sandbox: sb}), nil
}

func (n *fakeNode) ListSandboxes(context.Context, *connect.Request[nodev1.ListSandboxesRequest]) (*connect.Response[nodev1.ListSandboxesResponse], error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	out := &nodev1.ListSandboxesResponse{}
	for _, sb := range n.sbs {
		out.Sandboxes = append(out.Sandboxes, sb)
	}
	return connect.NewResponse(out), nil
}

func (n *fakeNode) Info(context.Context, *connect.Request[nodev1.InfoRequest]) (*connect.Response[nodev1.InfoResponse], error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	var mem int64
	for _, sb := range n.sbs {
		mem += sb.GetSpec().GetMemoryMb()
	}
	return connect.NewResponse(&nodev1.InfoResponse{
		NodeId: n.id, Backends: []string{"container"}, DefaultBackend: "container", Healthy: true,
		Total:  &nodev1.Capacity{Cpu: 8, MemoryMb: 8192, Sandboxes: n.maxSbs},
		Used:   &nodev1.Capacity{Cpu: float64(len(n.sbs)), MemoryMb: mem, Sandboxes: int64(len(n.sbs))},
		Images: n.images,
	}), nil
}

func (n *fakeNode) serveAgent(w http.ResponseWriter, r *http.Request) {
	rest := strings.TrimPrefix(r.URL.Path, "/agent/")
	id, sub, _ := strings.Cut(rest, "/")
	n.mu.Lock()
	sb, ok := n.sbs[id]
	n.mu.Unlock()
	if !ok {
		auth.WriteError(w, errdefs.New(errdefs.ErrNotFound, "sandbox %s not found", id))
		return
	}
	if sb.GetState() == nodev1.SandboxState_SANDBOX_STATE_FAILED {
		// As the node answers a call into a sandbox that died.
		reason := strings.TrimPrefix(sb.GetReason(), "died: ")
		w.Header().Set("Content-Type", "application/json; charset=utf-8")
		w.WriteHeader(http.StatusBadRequest)
		json.NewEncoder(w).Encode(map[string]any{"code": 400, "status": "failed_precondition", "died": reason,
			"message": errdefs.SandboxDied(id, reason).Error()})
		return
	}
	r2 := r.Clone(r.Context())
	r2.URL.Path = "/" + sub
	n.agent.ServeHTTP(w, r2)
}

// fakeAgent speaks the envd protocol over an in-memory file system and a
// few scripted programs.
type fakeAgent struct {
	mux *http.ServeMux

	mu      sync.Mutex
	files   map[string][]byte
	dirs    map[string]bool
	procs   map[uint32]*fakeProc
	nextPid uint32
	// Headers of the last Start call.
	lastStart http.Header
	// Ports: in-sandbox port -> loopback address standing in for it.
	ports map[uint32]string
}

type fakeProc struct {
	cmd    string
	args   []string
	tag    string
	input  chan []byte
	closed chan struct{}
	sig    chan process.Signal
	resize chan *process.PTY_Size
}

func newFakeAgent() *fakeAgent {
	a := &fakeAgent{files: map[string][]byte{}, dirs: map[string]bool{"/": true, "/tmp": true}, procs: map[uint32]*fakeProc{}, nextPid: 100, ports: map[uint32]string{}}
	a.mux = http.NewServeMux()
	a.mux.Handle(processconnect.NewProcessHandler(a))
	a.mux.Handle(filesystemconnect.NewFilesystemHandler(fakeFS{a}))
	a.mux.HandleFunc("GET /files", a.getFile)
	a.mux.HandleFunc("POST /files", a.postFile)
	a.mux.HandleFunc("GET /_opendsec/port/{port}", a.tunnel)
	return a
}

func (a *fakeAgent) ServeHTTP(w http.ResponseWriter, r *http.Request) { a.mux.ServeHTTP(w, r) }

func userOf(h http.Header) string {
	b, err := base64.StdEncoding.DecodeString(strings.TrimPrefix(h.Get("Authorization"), "Basic "))
	if err != nil {
		return ""
	}
	u, _, _ := strings.Cut(string(b), ":")
	return u
}

func writeJSONErr(w http.ResponseWriter, code int, msg string) {
	w.Header().Set("Content-Type", "application/json; charset=utf-8")
	w.WriteHeader(code)
	json.NewEncoder(w).Encode(map[string]any{"code": code, "message": msg})
}

func (a *fakeAgent) getFile(w http.ResponseWriter, r *http.Request) {
	p := r.URL.Query().Get("path")
	a.mu.Lock()
	b, ok := a.files[p]
	a.mu.Unlock()
	if !ok {
		writeJSONErr(w, http.StatusNotFound, fmt.Sprintf("path '%s' does not exist", p))
		return
	}
	w.Write(b)
}

// postFile writes as it reads, like a naive agent: an upload cut short
// leaves a partial file for the apiserver to clean up.
func (a *fakeAgent) postFile(w http.ResponseWriter, r *http.Request) {
	p := r.URL.Query().Get("path")
	if r.Header.Get("Content-Type") != "application/octet-stream" {
		writeJSONErr(w, http.StatusBadRequest, "want application/octet-stream")
		return
	}
	if strings.HasPrefix(p, "/run/opendsec/") || strings.HasPrefix(p, "/.opendsec/") { // like the real agent's reserved paths
		writeJSONErr(w, http.StatusForbidden, fmt.Sprintf("write '%s': permission denied: the path belongs to the sandbox's agent", p))
		return
	}
	a.mu.Lock()
	a.files[p] = nil
	a.mu.Unlock()
	buf := make([]byte, 64<<10)
	for {
		n, err := r.Body.Read(buf)
		a.mu.Lock()
		// Like writes to an open fd: a removed file stays removed.
		if _, ok := a.files[p]; ok {
			a.files[p] = append(a.files[p], buf[:n]...)
		}
		a.mu.Unlock()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return
		}
	}
	json.NewEncoder(w).Encode([]map[string]string{{"path": p, "name": path.Base(p), "type": "file"}})
}

func (a *fakeAgent) tunnel(w http.ResponseWriter, r *http.Request) {
	var port uint32
	fmt.Sscan(r.PathValue("port"), &port)
	a.mu.Lock()
	addr, ok := a.ports[port]
	a.mu.Unlock()
	if !ok || !strings.EqualFold(r.Header.Get("Upgrade"), "tcp") {
		writeJSONErr(w, http.StatusBadGateway, fmt.Sprintf("port %d is not open in the sandbox", port))
		return
	}
	up, err := net.Dial("tcp", addr)
	if err != nil {
		writeJSONErr(w, http.StatusBadGateway, err.Error())
		return
	}
	conn, brw, err := http.NewResponseController(w).Hijack()
	if err != nil {
		up.Close()
		return
	}
	brw.WriteString("HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: tcp\r\n\r\n")
	brw.Flush()
	// Half-closes both ways, like the agent's splice: the caller may keep
	// writing after the port's EOF.
	toUp := make(chan struct{})
	go func() { io.Copy(up, brw); up.(*net.TCPConn).CloseWrite(); close(toUp) }()
	io.Copy(conn, up)
	if cw, ok := conn.(interface{ CloseWrite() error }); ok {
		cw.CloseWrite()
		<-toUp
	}
	conn.Close()
	up.Close()
}

func (a *fakeAgent) proc(sel *process.ProcessSelector) (*fakeProc, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	p, ok := a.procs[sel.GetPid()]
	if !ok {
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("process with pid %d not found", sel.GetPid()))
	}
	return p, nil
}

func (a *fakeAgent) Start(ctx context.Context, req *connect.Request[process.StartRequest], stream *connect.ServerStream[process.StartResponse]) error {
	cfg := req.Msg.GetProcess()
	p := &fakeProc{cmd: cfg.GetCmd(), args: cfg.GetArgs(), tag: req.Msg.GetTag(), input: make(chan []byte, 16), closed: make(chan struct{}),
		sig: make(chan process.Signal, 1), resize: make(chan *process.PTY_Size, 1)}
	a.mu.Lock()
	a.lastStart = req.Header().Clone()
	a.nextPid++
	pid := a.nextPid
	a.procs[pid] = p
	a.mu.Unlock()
	defer func() {
		a.mu.Lock()
		delete(a.procs, pid)
		a.mu.Unlock()
	}()
	send := func(ev *process.ProcessEvent) error { return stream.Send(&process.StartResponse{Event: ev}) }
	out := func(b []byte) error {
		return send(&process.ProcessEvent{Event: &process.ProcessEvent_Data{Data: &process.ProcessEvent_DataEvent{Output: &process.ProcessEvent_DataEvent_Stdout{Stdout: b}}}})
	}
	end := func(code int32, exited bool, status string) error {
		return send(&process.ProcessEvent{Event: &process.ProcessEvent_End{End: &process.ProcessEvent_EndEvent{ExitCode: code, Exited: exited, Status: status}}})
	}
	if err := send(&process.ProcessEvent{Event: &process.ProcessEvent_Start{Start: &process.ProcessEvent_StartEvent{Pid: pid}}}); err != nil {
		return err
	}
	// Lifetime from Connect-Timeout-Ms, as envd does.
	var lifetime <-chan time.Time
	if dl, ok := ctx.Deadline(); ok {
		lifetime = time.After(time.Until(dl) - 20*time.Millisecond)
	}
	switch p.cmd {
	case "echo":
		if err := out([]byte(strings.Join(p.args, " ") + "\n")); err != nil {
			return err
		}
		return end(0, true, "exit status 0")
	case "whoami":
		if err := out([]byte(userOf(req.Header()) + "\n")); err != nil {
			return err
		}
		return end(0, true, "exit status 0")
	case "flood":
		// flood: 10 stdout chunks of 1000 bytes, then 3 of stderr.
		for range 10 {
			if err := out(bytes.Repeat([]byte("o"), 1000)); err != nil {
				return err
			}
		}
		for range 3 {
			if err := send(&process.ProcessEvent{Event: &process.ProcessEvent_Data{Data: &process.ProcessEvent_DataEvent{Output: &process.ProcessEvent_DataEvent_Stderr{Stderr: bytes.Repeat([]byte("e"), 1000)}}}}); err != nil {
				return err
			}
		}
		return end(0, true, "exit status 0")
	case "fail":
		if err := send(&process.ProcessEvent{Event: &process.ProcessEvent_Data{Data: &process.ProcessEvent_DataEvent{Output: &process.ProcessEvent_DataEvent_Stderr{Stderr: []byte("boom")}}}}); err != nil {
			return err
		}
		return end(3, true, "exit status 3")
	case "cat", "sleep", "shell":
		for {
			select {
			case b := <-p.input:
				if p.cmd == "sleep" {
					continue
				}
				if err := out(b); err != nil {
					return err
				}
			case <-p.closed:
				// Input sent before the close comes first.
				for len(p.input) > 0 {
					if b := <-p.input; p.cmd != "sleep" {
						if err := out(b); err != nil {
							return err
						}
					}
				}
				return end(0, true, "exit status 0")
			case sz := <-p.resize:
				if err := send(&process.ProcessEvent{Event: &process.ProcessEvent_Data{Data: &process.ProcessEvent_DataEvent{Output: &process.ProcessEvent_DataEvent_Pty{Pty: []byte(fmt.Sprintf("%dx%d", sz.GetCols(), sz.GetRows()))}}}}); err != nil {
					return err
				}
			case s := <-p.sig:
				// Input and resizes the caller sent before the signal
				// come first (each RPC returned once its item was
				// queued; select would pick among ready ones at random).
				for len(p.input) > 0 || len(p.resize) > 0 {
					select {
					case b := <-p.input:
						if p.cmd != "sleep" {
							if err := out(b); err != nil {
								return err
							}
						}
					case sz := <-p.resize:
						if err := send(&process.ProcessEvent{Event: &process.ProcessEvent_Data{Data: &process.ProcessEvent_DataEvent{Output: &process.ProcessEvent_DataEvent_Pty{Pty: []byte(fmt.Sprintf("%dx%d", sz.GetCols(), sz.GetRows()))}}}}); err != nil {
							return err
						}
					}
				}
				return end(-1, false, "signal: "+s.String())
			case <-lifetime:
				return end(-1, false, "signal: killed")
			case <-ctx.Done():
				return ctx.Err()
			}
		}
	}
	return end(127, true, "exit status 127")
}

func (a *fakeAgent) List(context.Context, *connect.Request[process.ListRequest]) (*connect.Response[process.ListResponse], error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	out := &process.ListResponse{}
	for pid, p := range a.procs {
		out.Processes = append(out.Processes, &process.ProcessInfo{Pid: pid, Config: &process.ProcessConfig{Cmd: p.cmd, Args: p.args}, Tag: proto.String(p.tag)})
	}
	return connect.NewResponse(out), nil
}

func (a *fakeAgent) Connect(context.Context, *connect.Request[process.ConnectRequest], *connect.ServerStream[process.ConnectResponse]) error {
	return connect.NewError(connect.CodeUnimplemented, nil)
}

func (a *fakeAgent) StreamInput(context.Context, *connect.ClientStream[process.StreamInputRequest]) (*connect.Response[process.StreamInputResponse], error) {
	return nil, connect.NewError(connect.CodeUnimplemented, nil)
}

func (a *fakeAgent) Update(_ context.Context, req *connect.Request[process.UpdateRequest]) (*connect.Response[process.UpdateResponse], error) {
	p, err := a.proc(req.Msg.GetProcess())
	if err != nil {
		return nil, err
	}
	p.resize <- req.Msg.GetPty().GetSize()
	return connect.NewResponse(&process.UpdateResponse{}), nil
}

func (a *fakeAgent) SendInput(_ context.Context, req *connect.Request[process.SendInputRequest]) (*connect.Response[process.SendInputResponse], error) {
	p, err := a.proc(req.Msg.GetProcess())
	if err != nil {
		return nil, err
	}
	in := req.Msg.GetInput()
	b := in.GetStdin()
	if in.GetPty() != nil {
		b = append([]byte("pty:"), in.GetPty()...)
	}
	p.input <- b
	return connect.NewResponse(&process.SendInputResponse{}), nil
}

func (a *fakeAgent) SendSignal(_ context.Context, req *connect.Request[process.SendSignalRequest]) (*connect.Response[process.SendSignalResponse], error) {
	p, err := a.proc(req.Msg.GetProcess())
	if err != nil {
		return nil, err
	}
	p.sig <- req.Msg.GetSignal()
	return connect.NewResponse(&process.SendSignalResponse{}), nil
}

func (a *fakeAgent) CloseStdin(_ context.Context, req *connect.Request[process.CloseStdinRequest]) (*connect.Response[process.CloseStdinResponse], error) {
	p, err := a.proc(req.Msg.GetProcess())
	if err != nil {
		return nil, err
	}
	close(p.closed)
	return connect.NewResponse(&process.CloseStdinResponse{}), nil
}

// fakeFS is the filesystem.Filesystem side of fakeAgent.
type fakeFS struct{ a *fakeAgent }

func (f fakeFS) entry(p string) (*filesystem.EntryInfo, bool) {
	if f.a.dirs[p] {
		return &filesystem.EntryInfo{Name: path.Base(p), Path: p, Type: filesystem.FileType_FILE_TYPE_DIRECTORY, Mode: 0o755}, true
	}
	if b, ok := f.a.files[p]; ok {
		return &filesystem.EntryInfo{Name: path.Base(p), Path: p, Type: filesystem.FileType_FILE_TYPE_FILE, Size: int64(len(b)), Mode: 0o644}, true
	}
	return nil, false
}

func notExist(p string) error {
	return connect.NewError(connect.CodeNotFound, fmt.Errorf("path '%s' does not exist", p))
}

func (f fakeFS) Stat(_ context.Context, req *connect.Request[filesystem.StatRequest]) (*connect.Response[filesystem.StatResponse], error) {
	f.a.mu.Lock()
	defer f.a.mu.Unlock()
	e, ok := f.entry(req.Msg.GetPath())
	if !ok {
		return nil, notExist(req.Msg.GetPath())
	}
	e.Owner = userOf(req.Header())
	return connect.NewResponse(&filesystem.StatResponse{Entry: e}), nil
}

func (f fakeFS) MakeDir(_ context.Context, req *connect.Request[filesystem.MakeDirRequest]) (*connect.Response[filesystem.MakeDirResponse], error) {
	f.a.mu.Lock()
	defer f.a.mu.Unlock()
	p := req.Msg.GetPath()
	if f.a.dirs[p] {
		return nil, connect.NewError(connect.CodeAlreadyExists, fmt.Errorf("directory '%s' already exists", p))
	}
	f.a.dirs[p] = true
	e, _ := f.entry(p)
	return connect.NewResponse(&filesystem.MakeDirResponse{Entry: e}), nil
}

func (f fakeFS) Move(_ context.Context, req *connect.Request[filesystem.MoveRequest]) (*connect.Response[filesystem.MoveResponse], error) {
	f.a.mu.Lock()
	defer f.a.mu.Unlock()
	b, ok := f.a.files[req.Msg.GetSource()]
	if !ok {
		return nil, notExist(req.Msg.GetSource())
	}
	delete(f.a.files, req.Msg.GetSource())
	f.a.files[req.Msg.GetDestination()] = b
	e, _ := f.entry(req.Msg.GetDestination())
	return connect.NewResponse(&filesystem.MoveResponse{Entry: e}), nil
}

func (f fakeFS) ListDir(_ context.Context, req *connect.Request[filesystem.ListDirRequest]) (*connect.Response[filesystem.ListDirResponse], error) {
	f.a.mu.Lock()
	defer f.a.mu.Unlock()
	dir := req.Msg.GetPath()
	if !f.a.dirs[dir] {
		return nil, notExist(dir)
	}
	out := &filesystem.ListDirResponse{}
	var names []string
	for p := range f.a.files {
		if path.Dir(p) == dir {
			names = append(names, p)
		}
	}
	sort.Strings(names)
	for _, p := range names {
		e, _ := f.entry(p)
		out.Entries = append(out.Entries, e)
	}
	return connect.NewResponse(out), nil
}

func (f fakeFS) Remove(_ context.Context, req *connect.Request[filesystem.RemoveRequest]) (*connect.Response[filesystem.RemoveResponse], error) {
	f.a.mu.Lock()
	defer f.a.mu.Unlock()
	delete(f.a.files, req.Msg.GetPath())
	delete(f.a.dirs, req.Msg.GetPath())
	return connect.NewResponse(&filesystem.RemoveResponse{}), nil
}

func (fakeFS) WatchDir(context.Context, *connect.Request[filesystem.WatchDirRequest], *connect.ServerStream[filesystem.WatchDirResponse]) error {
	return connect.NewError(connect.CodeUnimplemented, nil)
}

func (fakeFS) CreateWatcher(context.Context, *connect.Request[filesystem.CreateWatcherRequest]) (*connect.Response[filesystem.CreateWatcherResponse], error) {
	return nil, connect.NewError(connect.CodeUnimplemented, nil)
}

func (fakeFS) GetWatcherEvents(context.Context, *connect.Request[filesystem.GetWatcherEventsRequest]) (*connect.Response[filesystem.GetWatcherEventsResponse], error) {
	return nil, connect.NewError(connect.CodeUnimplemented, nil)
}

func (fakeFS) RemoveWatcher(context.Context, *connect.Request[filesystem.RemoveWatcherRequest]) (*connect.Response[filesystem.RemoveWatcherResponse], error) {
	return nil, connect.NewError(connect.CodeUnimplemented, nil)
}

func mustIssuer(t *testing.T) *auth.Issuer {
	t.Helper()
	iss, err := auth.GenerateIssuer()
	if err != nil {
		t.Fatal(err)
	}
	return iss
}

// fakeSnaps is a fakeNode's NodeSnapshotService: records in n.snaps,
// every caller owning all of them.
type fakeSnaps struct{ n *fakeNode }

func (f fakeSnaps) CreateSnapshot(_ context.Context, req *connect.Request[nodev1.CreateSnapshotRequest]) (*connect.Response[nodev1.CreateSnapshotResponse], error) {
	f.n.mu.Lock()
	defer f.n.mu.Unlock()
	sb, err := f.n.get(req.Msg.GetSandboxId())
	if err != nil {
		return nil, err
	}
	s := &nodev1.Snapshot{Id: sandboxid.New(f.n.id), Name: req.Msg.GetName(),
		NodeId: f.n.id, SourceSandboxId: sb.GetId(), Spec: sb.GetSpec(), CreatedAt: timestamppb.Now()}
	s.Image = "snapshot/" + s.Id
	f.n.snaps[s.Id] = s
	return connect.NewResponse(&nodev1.CreateSnapshotResponse{Snapshot: s}), nil
}

func (f fakeSnaps) GetSnapshot(_ context.Context, req *connect.Request[nodev1.GetSnapshotRequest]) (*connect.Response[nodev1.GetSnapshotResponse], error) {
	f.n.mu.Lock()
	defer f.n.mu.Unlock()
	s, ok := f.n.snaps[req.Msg.GetId()]
	if !ok {
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("id: snapshot %s not found", req.Msg.GetId()))
	}
	return connect.NewResponse(&nodev1.GetSnapshotResponse{Snapshot: s}), nil
}

func (f fakeSnaps) ListSnapshots(context.Context, *connect.Request[nodev1.ListSnapshotsRequest]) (*connect.Response[nodev1.ListSnapshotsResponse], error) {
	f.n.mu.Lock()
	defer f.n.mu.Unlock()
	out := &nodev1.ListSnapshotsResponse{}
	for _, s := range f.n.snaps {
		out.Snapshots = append(out.Snapshots, s)
	}
	return connect.NewResponse(out), nil
}

func (f fakeSnaps) DeleteSnapshot(_ context.Context, req *connect.Request[nodev1.DeleteSnapshotRequest]) (*connect.Response[nodev1.DeleteSnapshotResponse], error) {
	f.n.mu.Lock()
	defer f.n.mu.Unlock()
	if _, ok := f.n.snaps[req.Msg.GetId()]; !ok {
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("id: snapshot %s not found", req.Msg.GetId()))
	}
	delete(f.n.snaps, req.Msg.GetId())
	return connect.NewResponse(&nodev1.DeleteSnapshotResponse{}), nil
}
