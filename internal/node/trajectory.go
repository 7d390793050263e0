package node

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"

	"github.com/kernflux/opendsec/api/gen/process"
	"github.com/kernflux/opendsec/api/gen/process/processconnect"
	"github.com/kernflux/opendsec/internal/auth"
	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/log"
	"github.com/kernflux/opendsec/internal/trajectory"
)

// The wire names of the log, in internal/trajectory (the apiserver and
// the E2B gateway use them without the node).
const (
	CallIDHeader      = trajectory.CallIDHeader
	OutputLimitHeader = trajectory.OutputLimitHeader
	CallSeqHeader     = trajectory.CallSeqHeader
	ReplayedHeader    = trajectory.ReplayedHeader
	JoinedHeader      = trajectory.JoinedHeader
	TrajectoryPath    = trajectory.Path
)

// TrajectoryLine is one line of TrajectoryPath's answer.
type TrajectoryLine = trajectory.Line

func (n *Node) serveTrajectory(w http.ResponseWriter, r *http.Request, id string) {
	meta, calls, err := n.Trajectory(r.Context(), id)
	if err != nil {
		writeJSONError(w, err)
		return
	}
	w.Header().Set("Content-Type", "application/x-ndjson")
	enc := json.NewEncoder(w)
	if err := enc.Encode(TrajectoryLine{Meta: &meta}); err != nil {
		return
	}
	noOutput := r.URL.Query().Get("output") == "0"
	for _, c := range calls {
		if noOutput {
			c.Output, c.Body = nil, nil
		}
		if err := enc.Encode(TrajectoryLine{Call: c}); err != nil {
			return
		}
	}
}

// TrajectoryConfig configures the trajectory log (node.trajectory).
type TrajectoryConfig struct {
	// Off turns the log (and exactly-once calls) off.
	Off bool
	// MaxBytes bounds one sandbox's log; MaxOutputBytes one stream of one
	// call; Retention how long a stopped sandbox's log is kept (negative:
	// removed at the stop); Sync fdatasyncs every begin and end. Zero
	// values are trajectory's defaults.
	MaxBytes, MaxOutputBytes int64
	Retention                time.Duration
	Sync                     bool
}

func openTrajectory(stateDir string, c TrajectoryConfig, clock func() time.Time) (*trajectory.Store, error) {
	if c.Off {
		return nil, nil
	}
	return trajectory.Open(trajectory.Options{
		Dir: stateDir + "/trajectory", MaxBytes: c.MaxBytes, MaxOutputBytes: c.MaxOutputBytes,
		Retention: c.Retention, Sync: c.Sync, Clock: clock,
	})
}

// Trajectory returns sandbox id's log (also of a stopped sandbox, within
// its retention) if the caller may see the sandbox.
func (n *Node) Trajectory(ctx context.Context, id string) (trajectory.Meta, []*trajectory.Call, error) {
	if n.traj == nil {
		return trajectory.Meta{}, nil, errdefs.New(errdefs.ErrFailedPrecondition, "the trajectory log is off on node %s (node.trajectory.off)", n.cfg.ID)
	}
	meta, calls, err := n.traj.Read(id)
	if errdefs.IsNotFound(err) {
		// Not found either way: one the caller does not own says the same.
		return meta, nil, errdefs.New(errdefs.ErrNotFound, "sandbox %s has no trajectory log on this node (no call ran in it, or its log's retention passed)", id)
	}
	if err != nil {
		return meta, nil, err
	}
	if err := n.mayReadLog(ctx, id, meta); err != nil {
		return trajectory.Meta{}, nil, err
	}
	return meta, calls, nil
}

// trajLog returns sb's log, made headed by its owner.
func (n *Node) trajLog(sb *sandbox) (*trajectory.Log, error) {
	n.mu.Lock()
	rec := sb.rec
	n.mu.Unlock()
	return n.traj.Log(sb.id, trajectory.Meta{Owner: rec.Owner, Project: rec.Project, ParentID: rec.ParentID})
}

// mayReadLog fails with not_found unless the caller in ctx owns the
// sandbox the log heads names.
func (n *Node) mayReadLog(ctx context.Context, id string, meta trajectory.Meta) error {
	if !callerOf(ctx).owns(&record{Owner: meta.Owner, Project: meta.Project}) {
		return errdefs.New(errdefs.ErrNotFound, "sandbox %s not found", id)
	}
	return nil
}

// trajCtxKey carries the sandbox and the lifetime the caller asked for from
// AgentProxy into the Start handler.
type trajCtxKey struct{}

type trajCall struct {
	sb      *sandbox
	timeout string // Connect-Timeout-Ms, taken off so that the handler has no deadline
}

// trajStartHandler serves process.Process/Start through the log. It speaks
// every protocol and codec connect-go does (envd SDKs use Connect with
// JSON or proto).
func (n *Node) trajStartHandler() http.Handler {
	n.trajOnce.Do(func() {
		// Events are small and the hop is to the apiserver or a local
		// caller: compressing each costs more than it saves.
		n.trajHandler = connect.NewServerStreamHandler(processconnect.ProcessStartProcedure, n.trajStart,
			connect.WithInterceptors(errdefs.Interceptor()), connect.WithCompressMinBytes(64<<10))
	})
	return n.trajHandler
}

// serveTrajStart hands a Start to the log's handler. The caller's timeout
// header is the process lifetime (envd's meaning), not this call's: it is
// taken off before connect-go would make it the handler's deadline.
func (n *Node) serveTrajStart(w http.ResponseWriter, r *http.Request, sb *sandbox) {
	tc := &trajCall{sb: sb, timeout: r.Header.Get("Connect-Timeout-Ms")}
	r.Header.Del("Connect-Timeout-Ms")
	if g := r.Header.Get("Grpc-Timeout"); g != "" && tc.timeout == "" {
		if d, ok := grpcTimeout(g); ok {
			tc.timeout = strconv.FormatInt(d.Milliseconds(), 10)
		}
	}
	r.Header.Del("Grpc-Timeout")
	r.URL.Path = processconnect.ProcessStartProcedure
	n.trajStartHandler().ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), trajCtxKey{}, tc)))
}

func grpcTimeout(v string) (time.Duration, bool) {
	if len(v) < 2 {
		return 0, false
	}
	num, err := strconv.ParseInt(v[:len(v)-1], 10, 64)
	if err != nil {
		return 0, false
	}
	unit := map[byte]time.Duration{'H': time.Hour, 'M': time.Minute, 'S': time.Second, 'm': time.Millisecond, 'u': time.Microsecond, 'n': time.Nanosecond}[v[len(v)-1]]
	if unit == 0 {
		return 0, false
	}
	return time.Duration(num) * unit, true
}

// basicUserOf is the user of an envd "Authorization: Basic" header.
func basicUserOf(h http.Header) string {
	a := h.Get("Authorization")
	if len(a) < 6 || !strings.EqualFold(a[:6], "basic ") {
		return ""
	}
	b, err := base64.StdEncoding.DecodeString(strings.TrimSpace(a[6:]))
	if err != nil {
		return ""
	}
	u, _, _ := strings.Cut(string(b), ":")
	return u
}

func startRequestOf(m *process.StartRequest, h http.Header, timeout string) trajectory.Request {
	cfg := m.GetProcess()
	r := trajectory.Request{
		Kind:    trajectory.KindExec,
		Command: append([]string{cfg.GetCmd()}, cfg.GetArgs()...),
		Env:     cfg.GetEnvs(),
		Cwd:     cfg.GetCwd(),
		User:    basicUserOf(h),
		Stdin:   m.GetStdin(),
		Pty:     m.Pty != nil,
		Tag:     m.GetTag(),
	}
	if len(r.Env) == 0 {
		r.Env = nil
	}
	r.TimeoutMs, _ = strconv.ParseInt(timeout, 10, 64)
	return r
}

// forwardedHeaders are the caller's headers the agent sees on a Start the
// log makes: all but the node's credentials, the log's own and the
// transport's and protocol's, which the node's client sets itself.
func forwardedHeaders(dst, src http.Header) {
	for k, vs := range src {
		switch ck := http.CanonicalHeaderKey(k); {
		case ck == "Content-Type", ck == "Content-Length", ck == "Content-Encoding", ck == "Accept-Encoding",
			ck == "Te", ck == "Trailer", ck == "Transfer-Encoding", ck == "Connection", ck == "Upgrade", ck == "Host",
			strings.HasPrefix(ck, "Connect-"), strings.HasPrefix(ck, "Grpc-"), strings.HasPrefix(ck, "Opendsec-"),
			ck == http.CanonicalHeaderKey(auth.TokenHeader), ck == http.CanonicalHeaderKey(auth.OnBehalfHeader):
			continue
		case ck == "Authorization":
			if basicUserOf(src) == "" && len(vs) > 0 && !strings.HasPrefix(strings.ToLower(vs[0]), "basic") {
				continue // the node's bearer token
			}
		}
		dst[http.CanonicalHeaderKey(k)] = append([]string(nil), vs...)
	}
}

// trajStart is process.Process/Start through the trajectory log: a new call
// is recorded before its process starts, a call ID the log has is replayed
// or joined, and one with another request is refused.
func (n *Node) trajStart(ctx context.Context, req *connect.Request[process.StartRequest], stream *connect.ServerStream[process.StartResponse]) error {
	tc, _ := ctx.Value(trajCtxKey{}).(*trajCall)
	if tc == nil {
		return errdefs.New(errdefs.ErrInternal, "trajectory start without its sandbox")
	}
	sb := tc.sb
	callID := req.Header().Get(CallIDHeader)
	var outCap int64
	if v := req.Header().Get(OutputLimitHeader); v != "" {
		c, err := strconv.ParseInt(v, 10, 64)
		if err != nil || c < 0 {
			return errdefs.Invalid(OutputLimitHeader, "%q is not a byte count ≥ 0", v)
		}
		outCap = c
	}
	treq := startRequestOf(req.Msg, req.Header(), tc.timeout)
	lg, err := n.trajLog(sb)
	if err != nil {
		return err
	}
	c, prior, err := lg.Begin(callID, treq, outCap)
	if err != nil {
		return err
	}
	if prior != nil {
		stream.ResponseHeader().Set(CallSeqHeader, strconv.FormatUint(prior.Seq, 10))
		if prior.State == trajectory.StateRunning {
			stream.ResponseHeader().Set(JoinedHeader, "true")
			n.ensurePump(sb, lg, prior)
			return n.follow(ctx, lg, prior.Seq, stream)
		}
		stream.ResponseHeader().Set(ReplayedHeader, "true")
		return replay(prior, stream.Send)
	}
	stream.ResponseHeader().Set(CallSeqHeader, strconv.FormatUint(c.Seq, 10))

	creq := connect.NewRequest(req.Msg)
	forwardedHeaders(creq.Header(), req.Header())
	if tc.timeout != "" {
		creq.Header().Set("Connect-Timeout-Ms", tc.timeout)
	}
	p := &pump{events: make(chan *process.StartResponse), gone: make(chan struct{})}
	n.pumps.Store(pumpKey(sb.id, c.Seq), p)
	go n.runPump(sb, lg, c.Seq, p, func(pctx context.Context) (eventStream, error) {
		out, err := n.agentProcessClient(sb).Start(pctx, creq)
		if err != nil {
			return nil, err
		}
		return startStream{out}, nil
	})
	defer close(p.gone)
	events := p.events
	for {
		select {
		case ev, ok := <-events:
			if !ok {
				return p.err
			}
			if err := stream.Send(ev); err != nil {
				return err
			}
		case <-ctx.Done():
			return context.Cause(ctx)
		}
	}
}

func (n *Node) agentProcessClient(sb *sandbox) processconnect.ProcessClient {
	// A unix socket or vsock to the agent: nothing to gain from gzip.
	return processconnect.NewProcessClient(&http.Client{Transport: n.agentTransport(sb)}, "http://agent",
		connect.WithAcceptCompression("gzip", nil, nil))
}

func pumpKey(id string, seq uint64) string { return id + "/" + strconv.FormatUint(seq, 10) }

// pump reads one call's process events from the agent into the log, for as
// long as the process runs, whoever listens: the caller that started it
// gets every event on events (until it goes away: gone), later callers of
// its ID follow the log.
type pump struct {
	events chan *process.StartResponse // closed at the end, after err is set; nil for a re-attach
	gone   chan struct{}               // the first caller left
	err    error
	// reattach: the pump follows a process a previous node process
	// started (agent Connect by pid).
	reattach bool
}

// eventStream is the agent's Start or Connect stream.
type eventStream interface {
	Receive() bool
	Event() *process.ProcessEvent
	Err() error
	Close() error
}

type startStream struct {
	*connect.ServerStreamForClient[process.StartResponse]
}

func (s startStream) Event() *process.ProcessEvent { return s.Msg().GetEvent() }

type connectStream struct {
	*connect.ServerStreamForClient[process.ConnectResponse]
}

func (s connectStream) Event() *process.ProcessEvent { return s.Msg().GetEvent() }

// runPump runs one call's stream to its end and records the end. A node
// shutting down leaves the call running in the log: the next start
// re-attaches to its process.
func (n *Node) runPump(sb *sandbox, lg *trajectory.Log, seq uint64, p *pump, open func(context.Context) (eventStream, error)) {
	defer n.pumps.Delete(pumpKey(sb.id, seq))
	events := p.events
	if events != nil {
		defer close(events)
	}
	send := func(ev *process.ProcessEvent) {
		if events == nil {
			return
		}
		select {
		case events <- &process.StartResponse{Event: ev}:
		case <-p.gone: // the first caller left; the log goes on
			events = nil
		}
	}
	finish := func(r trajectory.Result) {
		if n.life.Err() != nil {
			return // node stopping: leave it running for the next start
		}
		// A re-attached process's output from before the node restarted
		// was never recorded.
		r.OutputLost = p.reattach
		if _, err := lg.Finish(seq, r); err != nil {
			log.G(n.life).Warn("record call end", log.SandboxID(sb.id), "seq", seq, log.Err(err))
		}
	}
	lost := func(err error) bool {
		if !p.reattach || connect.CodeOf(err) != connect.CodeNotFound {
			return false
		}
		// A re-attach to a process the agent no longer knows.
		finish(trajectory.Result{Interrupted: true, ErrCode: connect.CodeFailedPrecondition.String(),
			ErrMsg: "the node restarted while the call ran and its process's end was no longer to be had; the call was not run again"})
		return true
	}
	out, err := open(n.life)
	if err != nil {
		p.err = err
		if !lost(err) {
			finish(errResult(err))
		}
		return
	}
	defer out.Close()
	var res trajectory.Result
	var endEv *process.ProcessEvent
	for out.Receive() {
		ev := out.Event()
		switch e := ev.GetEvent().(type) {
		case *process.ProcessEvent_Start:
			if err := lg.SetPid(seq, e.Start.GetPid()); err != nil {
				log.G(n.life).Warn("record call pid", log.SandboxID(sb.id), "seq", seq, log.Err(err))
			}
		case *process.ProcessEvent_Data:
			switch d := e.Data.GetOutput().(type) {
			case *process.ProcessEvent_DataEvent_Stdout:
				lg.AddOutput(seq, trajectory.Stdout, d.Stdout)
			case *process.ProcessEvent_DataEvent_Stderr:
				lg.AddOutput(seq, trajectory.Stderr, d.Stderr)
			case *process.ProcessEvent_DataEvent_Pty:
				lg.AddOutput(seq, trajectory.PTY, d.Pty)
			}
		case *process.ProcessEvent_End:
			res.End = true
			res.Exited, res.ExitCode, res.Status, res.ExitErr = e.End.GetExited(), e.End.GetExitCode(), e.End.GetStatus(), e.End.GetError()
			// Held until the end is recorded (below): a caller that saw
			// the end finds the call in the log even if the node dies
			// right after.
			endEv = ev
			continue
		}
		send(ev)
	}
	if err := out.Err(); err != nil {
		p.err = err
		if !res.End && lost(err) {
			return
		}
		r := errResult(err)
		res.ErrCode, res.ErrMsg = r.ErrCode, r.ErrMsg
	} else if !res.End {
		res.ErrCode, res.ErrMsg = connect.CodeUnavailable.String(), "the agent ended the process stream without an exit event; the sandbox may have stopped"
	}
	finish(res)
	if endEv != nil {
		send(endEv)
	}
}

func errResult(err error) trajectory.Result {
	var ce *connect.Error
	if errors.As(err, &ce) {
		return trajectory.Result{ErrCode: ce.Code().String(), ErrMsg: ce.Message()}
	}
	return trajectory.Result{ErrCode: errdefs.Code(err).String(), ErrMsg: errdefs.PublicMessage(err)}
}

// ensurePump starts re-attaching to a running call's process when no pump
// of this node process reads it: the node restarted while it ran.
func (n *Node) ensurePump(sb *sandbox, lg *trajectory.Log, c *trajectory.Call) {
	p := &pump{gone: make(chan struct{}), reattach: true}
	close(p.gone)
	if _, loaded := n.pumps.LoadOrStore(pumpKey(sb.id, c.Seq), p); loaded {
		return
	}
	if c.Pid == 0 {
		// Begun, and the node went before the agent said it started: it
		// may or may not have.
		n.pumps.Delete(pumpKey(sb.id, c.Seq))
		if _, err := lg.Finish(c.Seq, trajectory.Result{Interrupted: true, ErrCode: connect.CodeFailedPrecondition.String(),
			ErrMsg: "the node restarted while the call was starting; whether its process ran is unknown, and it was not run again"}); err != nil {
			log.G(n.life).Warn("record interrupted call", log.SandboxID(sb.id), "seq", c.Seq, log.Err(err))
		}
		return
	}
	pid := c.Pid
	go n.runPump(sb, lg, c.Seq, p, func(pctx context.Context) (eventStream, error) {
		out, err := n.agentProcessClient(sb).Connect(pctx, connect.NewRequest(&process.ConnectRequest{
			Process: &process.ProcessSelector{Selector: &process.ProcessSelector_Pid{Pid: pid}}}))
		if err != nil {
			return nil, err
		}
		return connectStream{out}, nil
	})
}

// reattachTrajectories re-attaches, in the background, to the calls that
// were running in sandboxes the node recovered.
func (n *Node) reattachTrajectories() {
	if n.traj == nil {
		return
	}
	n.mu.Lock()
	var sbs []*sandbox
	for _, sb := range n.sandboxes {
		if sb.rec.State == stateRunning || sb.rec.State == statePaused {
			sbs = append(sbs, sb)
		}
	}
	n.mu.Unlock()
	for _, sb := range sbs {
		lg, err := n.trajLog(sb)
		if err != nil {
			continue
		}
		for _, c := range lg.Running() {
			n.ensurePump(sb, lg, c)
		}
	}
}

// follow streams call seq from the log to a caller that joined it: what it
// has recorded, then what comes, then its end.
func (n *Node) follow(ctx context.Context, lg *trajectory.Log, seq uint64, stream *connect.ServerStream[process.StartResponse]) error {
	sentPid := false
	chunk, off := 0, 0
	for {
		c, changed := lg.Watch(seq)
		if c == nil {
			return errdefs.New(errdefs.ErrNotFound, "call %d is gone from the trajectory log", seq)
		}
		if !sentPid && c.Pid != 0 {
			if err := stream.Send(startEv(c.Pid)); err != nil {
				return err
			}
			sentPid = true
		}
		if sentPid {
			for ; chunk < len(c.Output); chunk, off = chunk+1, 0 {
				ch := c.Output[chunk]
				if off < len(ch.Data) {
					if err := stream.Send(dataEv(ch.Stream, ch.Data[off:])); err != nil {
						return err
					}
				}
				off = len(ch.Data)
				if chunk == len(c.Output)-1 {
					break // the last chunk may still grow
				}
			}
		}
		if c.State != trajectory.StateRunning {
			if !sentPid {
				if err := stream.Send(startEv(c.Pid)); err != nil {
					return err
				}
			}
			return endOf(c, stream.Send)
		}
		select {
		case <-changed:
		case <-ctx.Done():
			return context.Cause(ctx)
		}
	}
}

func startEv(pid uint32) *process.StartResponse {
	return &process.StartResponse{Event: &process.ProcessEvent{Event: &process.ProcessEvent_Start{Start: &process.ProcessEvent_StartEvent{Pid: pid}}}}
}

func dataEv(stream string, b []byte) *process.StartResponse {
	d := &process.ProcessEvent_DataEvent{}
	switch stream {
	case trajectory.Stderr:
		d.Output = &process.ProcessEvent_DataEvent_Stderr{Stderr: b}
	case trajectory.PTY:
		d.Output = &process.ProcessEvent_DataEvent_Pty{Pty: b}
	default:
		d.Output = &process.ProcessEvent_DataEvent_Stdout{Stdout: b}
	}
	return &process.StartResponse{Event: &process.ProcessEvent{Event: &process.ProcessEvent_Data{Data: d}}}
}

// replay sends a recorded call as the agent sent it: start, output, end,
// then the error it ended with, if any.
func replay(c *trajectory.Call, send func(*process.StartResponse) error) error {
	if err := send(startEv(c.Pid)); err != nil {
		return err
	}
	for _, ch := range c.Output {
		if err := send(dataEv(ch.Stream, ch.Data)); err != nil {
			return err
		}
	}
	return endOf(c, send)
}

func endOf(c *trajectory.Call, send func(*process.StartResponse) error) error {
	if c.End {
		end := &process.ProcessEvent_EndEvent{ExitCode: c.ExitCode, Exited: c.Exited, Status: c.Status}
		if c.ExitErr != "" {
			end.Error = &c.ExitErr
		}
		if err := send(&process.StartResponse{Event: &process.ProcessEvent{Event: &process.ProcessEvent_End{End: end}}}); err != nil {
			return err
		}
	}
	if c.ErrCode != "" {
		var code connect.Code
		if err := code.UnmarshalText([]byte(c.ErrCode)); err != nil {
			code = connect.CodeUnknown
		}
		msg := c.ErrMsg
		if c.State == trajectory.StateInterrupted {
			msg = fmt.Sprintf("call %d (call_id %q): %s", c.Seq, c.CallID, msg)
		}
		return connect.NewError(code, errors.New(msg))
	}
	return nil
}

// trajSweepEvery is how often the reaper removes logs past their
// retention.
const trajSweepEvery = time.Minute

// sweepTrajectories removes, once a trajSweepEvery, the logs of stopped
// sandboxes whose retention passed.
func (n *Node) sweepTrajectories(now time.Time) {
	if n.traj == nil || now.Sub(n.lastSweep) < trajSweepEvery {
		return
	}
	n.lastSweep = now
	live := func(id string) bool {
		n.mu.Lock()
		defer n.mu.Unlock()
		_, ok := n.sandboxes[id]
		return ok
	}
	if k, err := n.traj.Sweep(live); err != nil {
		log.G(n.life).Warn("sweep trajectory logs", log.Err(err))
	} else if k > 0 {
		log.G(n.life).Info("trajectory logs past their retention removed", "count", k)
	}
}

// trajState holds the node's trajectory fields.
type trajState struct {
	traj        *trajectory.Store
	trajOnce    sync.Once
	trajHandler http.Handler
	pumps       sync.Map  // pumpKey → *pump
	lastSweep   time.Time // reapLoop only
}
