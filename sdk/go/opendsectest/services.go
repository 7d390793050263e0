package opendsectest

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"path"
	"sort"
	"strings"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/api/gen/opendsec/v1/opendsecv1connect"
)

type sandboxService struct {
	opendsecv1connect.UnimplementedSandboxServiceHandler
	s *Server
}

var _ opendsecv1connect.SandboxServiceHandler = sandboxService{}

func (h sandboxService) CreateSandbox(ctx context.Context, req *connect.Request[opendsecv1.CreateSandboxRequest]) (*connect.Response[opendsecv1.CreateSandboxResponse], error) {
	s := h.s
	s.mu.Lock()
	s.createIDs = append(s.createIDs, req.Msg.GetRequestId())
	s.createSkips = append(s.createSkips, req.Msg.GetSkipWarmPool())
	fromPool := s.WarmPool && !req.Msg.GetSkipWarmPool()
	fail := s.failCreates > 0
	code, afterSave := s.failCode, s.failAfterSave
	if fail {
		s.failCreates--
	}
	s.mu.Unlock()
	if fail && !afterSave {
		return nil, connect.NewError(code, errors.New("injected failure"))
	}
	sb, err := s.create(req.Msg.GetSpec(), req.Msg.GetRequestId(), fromPool)
	if err != nil {
		return nil, err
	}
	if fail {
		return nil, connect.NewError(code, errors.New("injected failure after the sandbox was made"))
	}
	return connect.NewResponse(&opendsecv1.CreateSandboxResponse{Sandbox: sb}), nil
}

// PrewarmSandboxes records the request (Prewarms) and holds min(count,
// PoolRoom) (all when PoolRoom is 0), all ready.
func (h sandboxService) PrewarmSandboxes(_ context.Context, req *connect.Request[opendsecv1.PrewarmSandboxesRequest]) (*connect.Response[opendsecv1.PrewarmSandboxesResponse], error) {
	n := req.Msg.GetCount()
	if n < 1 || n > 1024 {
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("count: %d must be between 1 and 1024 (node.warm_pool.max_sandboxes)", n))
	}
	if err := validateSpec(req.Msg.GetSpec()); err != nil {
		return nil, err
	}
	s := h.s
	s.mu.Lock()
	defer s.mu.Unlock()
	s.prewarms = append(s.prewarms, proto.Clone(req.Msg).(*opendsecv1.PrewarmSandboxesRequest))
	held, reason := n, ""
	if s.PoolRoom > 0 && int32(s.PoolRoom) < n { //nolint:gosec // a test's small number
		held = int32(s.PoolRoom) //nolint:gosec // as above
		reason = fmt.Sprintf("capacity: node has room for %d more sandboxes", held)
	}
	ttl := req.Msg.GetTtlSeconds()
	if ttl == 0 {
		ttl = 600
	}
	return connect.NewResponse(&opendsecv1.PrewarmSandboxesResponse{Held: held, Ready: held, Reason: reason, TtlSeconds: ttl,
		Nodes: []*opendsecv1.PrewarmNodeResult{{NodeId: "fake", Held: held, Ready: held, Reason: reason}}}), nil
}

func (h sandboxService) BatchCreateSandboxes(ctx context.Context, req *connect.Request[opendsecv1.BatchCreateSandboxesRequest], stream *connect.ServerStream[opendsecv1.BatchCreateSandboxesResponse]) error {
	n := int(req.Msg.GetCount())
	if n < 1 || n > 32768 {
		return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("count: must be between 1 and 32768"))
	}
	if spec, _, err := h.s.fromSnapshot(req.Msg.GetSpec()); err != nil {
		return err
	} else if err := validateSpec(spec); err != nil {
		return err
	}
	h.s.mu.Lock()
	h.s.batchIDs = append(h.s.batchIDs, req.Msg.GetRequestId())
	h.s.batchSkips = append(h.s.batchSkips, req.Msg.GetSkipWarmPool())
	h.s.mu.Unlock()
	for i := range n {
		resp := &opendsecv1.BatchCreateSandboxesResponse{Index: int32(i)}
		var err error
		if h.s.BatchItemError != nil {
			err = h.s.BatchItemError(i)
		}
		if err == nil {
			resp.Sandbox, err = h.s.create(req.Msg.GetSpec(), fmt.Sprintf("%s-%d", req.Msg.GetRequestId(), i), h.s.WarmPool && !req.Msg.GetSkipWarmPool())
		}
		if err != nil {
			resp.ErrorCode = connect.CodeOf(err).String()
			var ce *connect.Error
			if errors.As(err, &ce) {
				resp.ErrorMessage = ce.Message()
			} else {
				resp.ErrorMessage = err.Error()
			}
		}
		if err := stream.Send(resp); err != nil {
			return err
		}
	}
	return nil
}

func (h sandboxService) GetSandbox(ctx context.Context, req *connect.Request[opendsecv1.GetSandboxRequest]) (*connect.Response[opendsecv1.GetSandboxResponse], error) {
	sb, err := h.s.sandbox(req.Msg.GetId())
	if err != nil {
		return nil, err
	}
	h.s.mu.Lock()
	defer h.s.mu.Unlock()
	return connect.NewResponse(&opendsecv1.GetSandboxResponse{Sandbox: proto.Clone(sb).(*opendsecv1.Sandbox)}), nil
}

func (h sandboxService) ListSandboxes(ctx context.Context, req *connect.Request[opendsecv1.ListSandboxesRequest]) (*connect.Response[opendsecv1.ListSandboxesResponse], error) {
	var out []*opendsecv1.Sandbox
	for _, sb := range h.s.Sandboxes() {
		if t := req.Msg.GetTaskId(); t != "" && sb.GetSpec().GetTaskId() != t {
			continue
		}
		if b := req.Msg.GetBackend(); b != "" && sb.GetSpec().GetBackend() != b {
			continue
		}
		match := true
		for k, v := range req.Msg.GetLabels() {
			if got, ok := sb.GetSpec().GetLabels()[k]; !ok || got != v {
				match = false
			}
		}
		if match {
			out = append(out, sb)
		}
	}
	return connect.NewResponse(&opendsecv1.ListSandboxesResponse{Sandboxes: out}), nil
}

func (h sandboxService) StopSandbox(ctx context.Context, req *connect.Request[opendsecv1.StopSandboxRequest]) (*connect.Response[opendsecv1.StopSandboxResponse], error) {
	if _, err := h.s.sandbox(req.Msg.GetId()); err != nil {
		return nil, err
	}
	h.s.mu.Lock()
	delete(h.s.sandboxes, req.Msg.GetId())
	delete(h.s.files, req.Msg.GetId())
	h.s.mu.Unlock()
	return connect.NewResponse(&opendsecv1.StopSandboxResponse{}), nil
}

// SetNetwork refuses a rule that sets both or neither of cidr and domain and a
// cidr that does not parse, naming the field like the real server; otherwise it
// stores the policy in the sandbox's spec.
func (h sandboxService) SetNetwork(ctx context.Context, req *connect.Request[opendsecv1.SetNetworkRequest]) (*connect.Response[opendsecv1.SetNetworkResponse], error) {
	for i, r := range req.Msg.GetNetwork().GetAllow() {
		if (r.GetCidr() == "") == (r.GetDomain() == "") {
			return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("network.allow[%d]: set exactly one of cidr and domain", i))
		}
		if c := r.GetCidr(); c != "" {
			if _, err := netip.ParsePrefix(c); err != nil {
				if _, err := netip.ParseAddr(c); err != nil {
					return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("network.allow[%d].cidr: %q is not an IPv4 prefix or address", i, c))
				}
			}
		}
	}
	sb, err := h.s.sandbox(req.Msg.GetId())
	if err != nil {
		return nil, err
	}
	h.s.mu.Lock()
	defer h.s.mu.Unlock()
	policy := req.Msg.GetNetwork()
	if policy == nil {
		policy = &opendsecv1.NetworkPolicy{}
	}
	if sb.Spec == nil {
		sb.Spec = &opendsecv1.SandboxSpec{}
	}
	sb.Spec.Network = proto.Clone(policy).(*opendsecv1.NetworkPolicy)
	return connect.NewResponse(&opendsecv1.SetNetworkResponse{Sandbox: proto.Clone(sb).(*opendsecv1.Sandbox)}), nil
}

func (h sandboxService) SetTimeout(ctx context.Context, req *connect.Request[opendsecv1.SetTimeoutRequest]) (*connect.Response[opendsecv1.SetTimeoutResponse], error) {
	if req.Msg.GetTimeoutSeconds() <= 0 || req.Msg.GetTimeoutSeconds() > 86400 {
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("timeout_seconds: must be between 1 and 86400"))
	}
	sb, err := h.s.sandbox(req.Msg.GetId())
	if err != nil {
		return nil, err
	}
	h.s.mu.Lock()
	defer h.s.mu.Unlock()
	sb.ExpiresAt = timestamppb.New(time.Now().Add(time.Duration(req.Msg.GetTimeoutSeconds()) * time.Second))
	return connect.NewResponse(&opendsecv1.SetTimeoutResponse{Sandbox: proto.Clone(sb).(*opendsecv1.Sandbox)}), nil
}

// ---- files ----

type fileService struct {
	opendsecv1connect.UnimplementedFileServiceHandler
	s *Server
}

var _ opendsecv1connect.FileServiceHandler = fileService{}

const readChunk = 1 << 20

func (h fileService) ReadFile(ctx context.Context, req *connect.Request[opendsecv1.ReadFileRequest], stream *connect.ServerStream[opendsecv1.ReadFileResponse]) error {
	if _, err := h.s.sandbox(req.Msg.GetSandboxId()); err != nil {
		return err
	}
	data, ok := h.s.File(req.Msg.GetSandboxId(), req.Msg.GetPath())
	if !ok {
		return connect.NewError(connect.CodeNotFound, fmt.Errorf("path %q: no such file", req.Msg.GetPath()))
	}
	for len(data) > 0 {
		n := min(len(data), readChunk)
		if err := stream.Send(&opendsecv1.ReadFileResponse{Data: data[:n]}); err != nil {
			return err
		}
		data = data[n:]
	}
	return nil
}

func (h fileService) WriteFile(ctx context.Context, stream *connect.ClientStream[opendsecv1.WriteFileRequest]) (*connect.Response[opendsecv1.WriteFileResponse], error) {
	if !stream.Receive() {
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("header: the first message must be a header"))
	}
	hdr := stream.Msg().GetHeader()
	if hdr == nil {
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("header: the first message must be a header"))
	}
	if _, err := h.s.sandbox(hdr.GetSandboxId()); err != nil {
		return nil, err
	}
	if h.s.MaxUploadBytes > 0 && hdr.GetSize() > h.s.MaxUploadBytes {
		return nil, connect.NewError(connect.CodeResourceExhausted, fmt.Errorf("size: %d bytes exceeds the upload limit of %d bytes", hdr.GetSize(), h.s.MaxUploadBytes))
	}
	var data []byte
	var chunks []int
	for stream.Receive() {
		d := stream.Msg().GetData()
		chunks = append(chunks, len(d))
		data = append(data, d...)
	}
	if err := stream.Err(); err != nil {
		return nil, err
	}
	h.s.PutFile(hdr.GetSandboxId(), hdr.GetPath(), data)
	h.s.mu.Lock()
	h.s.writeChunks = chunks
	h.s.mu.Unlock()
	return connect.NewResponse(&opendsecv1.WriteFileResponse{File: fileInfo(hdr.GetPath(), opendsecv1.FileType_FILE_TYPE_FILE, int64(len(data)))}), nil
}

func fileInfo(p string, t opendsecv1.FileType, size int64) *opendsecv1.FileInfo {
	mode := uint32(0o644)
	if t == opendsecv1.FileType_FILE_TYPE_DIRECTORY {
		mode = 0o755
	}
	return &opendsecv1.FileInfo{Name: path.Base(p), Path: p, Type: t, Size: size, Mode: mode, Owner: "root", Group: "root",
		ModifiedAt: timestamppb.New(time.Date(2025, 1, 2, 3, 4, 5, 0, time.UTC))}
}

func (h fileService) ListDir(ctx context.Context, req *connect.Request[opendsecv1.ListDirRequest]) (*connect.Response[opendsecv1.ListDirResponse], error) {
	id, dir := req.Msg.GetSandboxId(), path.Clean(req.Msg.GetPath())
	if _, err := h.s.sandbox(id); err != nil {
		return nil, err
	}
	h.s.mu.Lock()
	defer h.s.mu.Unlock()
	if !h.s.dirs[id][dir] {
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("path %q: no such directory", dir))
	}
	var out []*opendsecv1.FileInfo
	for p, b := range h.s.files[id] {
		if path.Dir(p) == dir {
			out = append(out, fileInfo(p, opendsecv1.FileType_FILE_TYPE_FILE, int64(len(b))))
		}
	}
	for p := range h.s.dirs[id] {
		if p != dir && path.Dir(p) == dir {
			out = append(out, fileInfo(p, opendsecv1.FileType_FILE_TYPE_DIRECTORY, 4096))
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return connect.NewResponse(&opendsecv1.ListDirResponse{Entries: out}), nil
}

func (h fileService) Stat(ctx context.Context, req *connect.Request[opendsecv1.StatRequest]) (*connect.Response[opendsecv1.StatResponse], error) {
	id, p := req.Msg.GetSandboxId(), req.Msg.GetPath()
	if _, err := h.s.sandbox(id); err != nil {
		return nil, err
	}
	h.s.mu.Lock()
	defer h.s.mu.Unlock()
	if b, ok := h.s.files[id][p]; ok {
		return connect.NewResponse(&opendsecv1.StatResponse{File: fileInfo(p, opendsecv1.FileType_FILE_TYPE_FILE, int64(len(b)))}), nil
	}
	if h.s.dirs[id][path.Clean(p)] {
		return connect.NewResponse(&opendsecv1.StatResponse{File: fileInfo(path.Clean(p), opendsecv1.FileType_FILE_TYPE_DIRECTORY, 4096)}), nil
	}
	return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("path %q: no such file or directory", p))
}

func (h fileService) Remove(ctx context.Context, req *connect.Request[opendsecv1.RemoveRequest]) (*connect.Response[opendsecv1.RemoveResponse], error) {
	id, p := req.Msg.GetSandboxId(), req.Msg.GetPath()
	if _, err := h.s.sandbox(id); err != nil {
		return nil, err
	}
	h.s.mu.Lock()
	defer h.s.mu.Unlock()
	_, isFile := h.s.files[id][p]
	if !isFile && !h.s.dirs[id][path.Clean(p)] {
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("path %q: no such file or directory", p))
	}
	delete(h.s.files[id], p)
	delete(h.s.dirs[id], path.Clean(p))
	return connect.NewResponse(&opendsecv1.RemoveResponse{}), nil
}

func (h fileService) MakeDir(ctx context.Context, req *connect.Request[opendsecv1.MakeDirRequest]) (*connect.Response[opendsecv1.MakeDirResponse], error) {
	id, p := req.Msg.GetSandboxId(), path.Clean(req.Msg.GetPath())
	if _, err := h.s.sandbox(id); err != nil {
		return nil, err
	}
	h.s.mu.Lock()
	defer h.s.mu.Unlock()
	created := !h.s.dirs[id][p]
	for d := p; d != "/" && d != "."; d = path.Dir(d) {
		h.s.dirs[id][d] = true
	}
	return connect.NewResponse(&opendsecv1.MakeDirResponse{File: fileInfo(p, opendsecv1.FileType_FILE_TYPE_DIRECTORY, 4096), Created: created}), nil
}

func (h fileService) Move(ctx context.Context, req *connect.Request[opendsecv1.MoveRequest]) (*connect.Response[opendsecv1.MoveResponse], error) {
	id := req.Msg.GetSandboxId()
	if _, err := h.s.sandbox(id); err != nil {
		return nil, err
	}
	h.s.mu.Lock()
	defer h.s.mu.Unlock()
	b, ok := h.s.files[id][req.Msg.GetSource()]
	if !ok {
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("source %q: no such file", req.Msg.GetSource()))
	}
	delete(h.s.files[id], req.Msg.GetSource())
	h.s.files[id][req.Msg.GetDestination()] = b
	return connect.NewResponse(&opendsecv1.MoveResponse{File: fileInfo(req.Msg.GetDestination(), opendsecv1.FileType_FILE_TYPE_FILE, int64(len(b)))}), nil
}

// ---- ports ----

type portService struct {
	opendsecv1connect.UnimplementedPortServiceHandler
	s *Server
}

var _ opendsecv1connect.PortServiceHandler = portService{}

// HTTPRequest answers as an echo server would: the body is
// "<method> <path>\n<request body>" and request headers come back prefixed
// with "Echo-".
func (h portService) HTTPRequest(ctx context.Context, req *connect.Request[opendsecv1.HTTPRequestRequest]) (*connect.Response[opendsecv1.HTTPRequestResponse], error) {
	if _, err := h.s.sandbox(req.Msg.GetSandboxId()); err != nil {
		return nil, err
	}
	resp := &opendsecv1.HTTPRequestResponse{
		Status: 200,
		Body:   []byte(req.Msg.GetMethod() + " " + req.Msg.GetPath() + "\n" + string(req.Msg.GetBody())),
	}
	for _, hd := range req.Msg.GetHeaders() {
		resp.Headers = append(resp.Headers, &opendsecv1.Header{Name: "Echo-" + hd.GetName(), Value: hd.GetValue()})
	}
	return connect.NewResponse(resp), nil
}

// ConnectPort behaves like an echo server listening on every port but 1
// and 2: data comes back as sent, and the stream ends after close_write.
// Port 1 refuses, as a port with nothing listening does. Port 2 sends
// "hello\n" and half-closes at once, then keeps what it receives until the
// caller half-closes (HalfClosedPortGot).
func (h portService) ConnectPort(ctx context.Context, stream *connect.BidiStream[opendsecv1.ConnectPortRequest, opendsecv1.ConnectPortResponse]) error {
	first, err := stream.Receive()
	if err != nil {
		return err
	}
	st := first.GetStart()
	if st == nil {
		return connect.NewError(connect.CodeInvalidArgument, errors.New("start: the first message must be start"))
	}
	if _, err := h.s.sandbox(st.GetSandboxId()); err != nil {
		return err
	}
	if st.GetPort() < 1 || st.GetPort() > 65535 {
		return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("port: %d must be between 1 and 65535", st.GetPort()))
	}
	if st.GetPort() == 1 {
		return connect.NewError(connect.CodeUnavailable, errors.New("connection refused in sandbox: port 1 is not open"))
	}
	if err := stream.Send(&opendsecv1.ConnectPortResponse{Event: &opendsecv1.ConnectPortResponse_Connected{Connected: &opendsecv1.ConnectPortConnected{}}}); err != nil {
		return err
	}
	if st.GetPort() == 2 {
		if err := stream.Send(&opendsecv1.ConnectPortResponse{Event: &opendsecv1.ConnectPortResponse_Data{Data: []byte("hello\n")}}); err != nil {
			return err
		}
		if err := stream.Send(&opendsecv1.ConnectPortResponse{Event: &opendsecv1.ConnectPortResponse_Eof{Eof: true}}); err != nil {
			return err
		}
		var got []byte
		for {
			m, err := stream.Receive()
			if errors.Is(err, io.EOF) || m.GetCloseWrite() {
				h.s.mu.Lock()
				h.s.halfClosedGot = got
				h.s.mu.Unlock()
				return nil
			}
			if err != nil {
				return err
			}
			got = append(got, m.GetData()...)
		}
	}
	for {
		m, err := stream.Receive()
		if errors.Is(err, io.EOF) || m.GetCloseWrite() {
			return nil
		}
		if err != nil {
			return err
		}
		if d := m.GetData(); len(d) > 0 {
			if err := stream.Send(&opendsecv1.ConnectPortResponse{Event: &opendsecv1.ConnectPortResponse_Data{Data: d}}); err != nil {
				return err
			}
		}
	}
}

// ---- processes ----

// ExecIO is what an ExecFunc sees of its stream.
type ExecIO struct {
	// Stdin reads what the client sends; EOF after close_stdin.
	Stdin io.Reader
	// Stdout and Stderr send output chunks to the client, in call order.
	Stdout, Stderr func([]byte)
	// Signals delivers signal numbers the client sends.
	Signals <-chan int32
}

// ExecFunc runs one fake process and returns its exit code and status.
type ExecFunc func(ctx context.Context, start *opendsecv1.ExecStart, io ExecIO) (exitCode int32, status string)

type processService struct {
	opendsecv1connect.UnimplementedProcessServiceHandler
	s *Server
}

var _ opendsecv1connect.ProcessServiceHandler = processService{}

func (h processService) Exec(ctx context.Context, stream *connect.BidiStream[opendsecv1.ExecRequest, opendsecv1.ExecResponse]) error {
	first, err := stream.Receive()
	if err != nil {
		return err
	}
	start := first.GetStart()
	if start == nil {
		return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("start: the first message must be start"))
	}
	if len(start.GetCommand()) == 0 {
		return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("command: must not be empty"))
	}
	if _, err := h.s.sandbox(start.GetSandboxId()); err != nil {
		return err
	}
	h.s.mu.Lock()
	h.s.execStarts = append(h.s.execStarts, proto.Clone(start).(*opendsecv1.ExecStart))
	h.s.mu.Unlock()
	if err := stream.Send(&opendsecv1.ExecResponse{Event: &opendsecv1.ExecResponse_Started{Started: &opendsecv1.ExecStarted{Pid: 42}}}); err != nil {
		return err
	}

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stdinR, stdinW := io.Pipe()
	signals := make(chan int32, 8)
	go func() {
		defer stdinW.Close()
		for {
			req, err := stream.Receive()
			if err != nil {
				return
			}
			switch m := req.GetMsg().(type) {
			case *opendsecv1.ExecRequest_Stdin:
				if _, err := stdinW.Write(m.Stdin); err != nil {
					return
				}
			case *opendsecv1.ExecRequest_CloseStdin:
				stdinW.Close()
			case *opendsecv1.ExecRequest_Resize:
				h.s.mu.Lock()
				h.s.resizes = append(h.s.resizes, m.Resize)
				h.s.mu.Unlock()
			case *opendsecv1.ExecRequest_Signal:
				select {
				case signals <- m.Signal:
				case <-ctx.Done():
					return
				}
			}
		}
	}()
	var sendErr error
	send := func(ev *opendsecv1.ExecResponse) {
		if sendErr == nil {
			sendErr = stream.Send(ev)
		}
	}
	eio := ExecIO{
		Stdin: stdinR,
		Stdout: func(b []byte) {
			send(&opendsecv1.ExecResponse{Event: &opendsecv1.ExecResponse_Stdout{Stdout: append([]byte(nil), b...)}})
		},
		Stderr: func(b []byte) {
			send(&opendsecv1.ExecResponse{Event: &opendsecv1.ExecResponse_Stderr{Stderr: append([]byte(nil), b...)}})
		},
		Signals: signals,
	}
	run := h.s.Exec
	if run == nil {
		run = Builtin
	}
	code, status := run(ctx, start, eio)
	stdinR.Close()
	send(&opendsecv1.ExecResponse{Event: &opendsecv1.ExecResponse_Exit{Exit: &opendsecv1.ExecExit{ExitCode: code, Status: status}}})
	return sendErr
}

// Builtin is the default ExecFunc. It knows: echo ARGS; cat (stdin to
// stdout); true; false; sleep (until a signal); and /bin/sh -c LINE where
// LINE is "; "-separated "echo WORDS [>&2]" and "exit N" commands.
// Anything else exits 127 with "<cmd>: not found" on stderr.
func Builtin(ctx context.Context, start *opendsecv1.ExecStart, eio ExecIO) (int32, string) {
	cmd := start.GetCommand()
	switch path.Base(cmd[0]) {
	case "echo":
		eio.Stdout([]byte(strings.Join(cmd[1:], " ") + "\n"))
		return 0, "exit status 0"
	case "cat":
		buf := make([]byte, 32<<10)
		for {
			n, err := eio.Stdin.Read(buf)
			if n > 0 {
				eio.Stdout(buf[:n])
			}
			if err != nil {
				return 0, "exit status 0"
			}
		}
	case "true":
		return 0, "exit status 0"
	case "false":
		return 1, "exit status 1"
	case "sleep":
		select {
		case sig := <-eio.Signals:
			return -1, fmt.Sprintf("signal: %d", sig)
		case <-ctx.Done():
			return -1, "signal: killed"
		}
	case "sh":
		if len(cmd) == 3 && cmd[1] == "-c" {
			return shell(cmd[2], eio)
		}
	}
	eio.Stderr([]byte(cmd[0] + ": not found\n"))
	return 127, "exit status 127"
}

func shell(line string, eio ExecIO) (int32, string) {
	for _, part := range strings.Split(line, "; ") {
		f := strings.Fields(part)
		if len(f) == 0 {
			continue
		}
		switch f[0] {
		case "echo":
			if f[len(f)-1] == ">&2" {
				eio.Stderr([]byte(strings.Join(f[1:len(f)-1], " ") + "\n"))
			} else {
				eio.Stdout([]byte(strings.Join(f[1:], " ") + "\n"))
			}
		case "exit":
			var code int32
			if len(f) > 1 {
				fmt.Sscan(f[1], &code)
			}
			return code, fmt.Sprintf("exit status %d", code)
		default:
			eio.Stderr([]byte("sh: " + f[0] + ": not found\n"))
			return 127, "exit status 127"
		}
	}
	return 0, "exit status 0"
}
