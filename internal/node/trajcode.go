package node

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/httphdr"
	"github.com/kernflux/opendsec/internal/interpreter"
	"github.com/kernflux/opendsec/internal/log"
	"github.com/kernflux/opendsec/internal/trajectory"
)

// Code-interpreter calls in the trajectory log. Every caller reaches the
// interpreter (interpreter.Port) through a port tunnel: GET
// /agent/<id>/_opendsec/port/49999 with Upgrade: tcp (the E2B gateway's
// run_code, the apiserver's HTTPRequest and ConnectPort). With the log on,
// the node does not splice that tunnel's bytes: it opens the agent's tunnel
// itself (a refusal goes back to the caller as the agent gave it), answers
// 101, and serves the caller's side as HTTP/1.1, one request after the
// other, each forwarded on a keep-alive tunnel to the interpreter with its
// answer streamed back as it comes (every read flushed). A POST /execute
// is a KindCode call: its code, language, context and env vars are the
// request, the interpreter's NDJSON lines its output (up to the call's
// cap), its error line its end. A CallIDHeader already in the log is
// answered from it (ReplayedHeader), joined while it runs (JoinedHeader),
// or refused (failed_precondition) with another request, as exec is.
// Every other request passes through untouched; an upgrade request turns
// the rest of the connection into a raw tunnel.

// codeTunnelPath is the agent path of the tunnel to the interpreter.
var codeTunnelPath = fmt.Sprintf("_opendsec/port/%d", interpreter.Port)

// Bounds of the HTTP the node reads on a code tunnel.
const (
	maxCodeHeaderBytes = 64 << 10 // a request's or an answer's head
	maxCodeBodyBytes   = 8 << 20  // an /execute request's body
	// maxCodeErrorLine bounds the line kept to find an error line's name.
	maxCodeErrorLine = 256 << 10
)

func isTCPUpgrade(h http.Header) bool {
	return httphdr.HasToken(h, "Connection", "upgrade") && httphdr.HasToken(h, "Upgrade", "tcp")
}

// dialAgentTunnel opens the agent's tunnel at sub. A refusal is the
// agent's answer (resp, with its body to be closed); err is the agent
// unreachable.
func (n *Node) dialAgentTunnel(ctx context.Context, sb *sandbox, sub string) (io.ReadWriteCloser, *http.Response, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://agent/"+sub, nil)
	if err != nil {
		return nil, nil, err
	}
	req.Header.Set("Connection", "Upgrade")
	req.Header.Set("Upgrade", "tcp")
	resp, err := n.agentTransport(sb).RoundTrip(req)
	if err != nil {
		return nil, nil, errdefs.New(errdefs.ErrUnavailable, "agent of sandbox %s unreachable: %w", sb.id, err)
	}
	if resp.StatusCode != http.StatusSwitchingProtocols {
		return nil, resp, nil
	}
	rwc, ok := resp.Body.(io.ReadWriteCloser)
	if !ok {
		resp.Body.Close()
		return nil, nil, errdefs.New(errdefs.ErrInternal, "the agent's tunnel is not writable")
	}
	return rwc, nil, nil
}

// serveCodeTunnel serves a tunnel to the interpreter's port through the
// log (see above).
func (n *Node) serveCodeTunnel(w http.ResponseWriter, r *http.Request, sb *sandbox, sub string) {
	sb.touch()
	defer sb.touch()
	lg, err := n.trajLog(sb)
	if err != nil {
		writeJSONError(w, err)
		return
	}
	up, refused, err := n.dialAgentTunnel(r.Context(), sb, sub)
	if err != nil {
		writeJSONError(w, err)
		return
	}
	if refused != nil {
		defer refused.Body.Close()
		for k, vs := range refused.Header {
			w.Header()[k] = vs
		}
		w.WriteHeader(refused.StatusCode)
		_, _ = io.Copy(w, io.LimitReader(refused.Body, 1<<20))
		return
	}
	conn, brw, err := http.NewResponseController(w).Hijack()
	if err != nil {
		up.Close()
		writeJSONError(w, errdefs.New(errdefs.ErrInternal, "hijack connection: %w", err))
		return
	}
	// The server's header deadline is not the tunnel's.
	_ = conn.SetDeadline(time.Time{})
	var buffered []byte
	if k := brw.Reader.Buffered(); k > 0 {
		b, _ := brw.Reader.Peek(k)
		buffered = bytes.Clone(b)
	}
	cs := &codeConn{
		n: n, sb: sb, lg: lg, sub: sub, conn: conn,
		lim: &headLimiter{r: io.MultiReader(bytes.NewReader(buffered), conn)},
		bw:  bufio.NewWriterSize(conn, 16<<10),
	}
	cs.br = bufio.NewReaderSize(cs.lim, 16<<10)
	cs.setUp(up)
	defer cs.close()
	stop := context.AfterFunc(n.life, cs.close)
	defer stop()
	if _, err := cs.bw.WriteString("HTTP/1.1 101 Switching Protocols\r\nUpgrade: tcp\r\nConnection: Upgrade\r\n\r\n"); err != nil {
		return
	}
	if cs.bw.Flush() != nil {
		return
	}
	for cs.serveOne() {
	}
}

// headLimiter bounds the bytes read while limited (a request's or an
// answer's head).
type headLimiter struct {
	r        io.Reader
	n        int64
	limited  bool
	exceeded bool
}

func (l *headLimiter) Read(p []byte) (int, error) {
	if l.limited {
		if l.n <= 0 {
			l.exceeded = true
			return 0, errors.New("HTTP head too large")
		}
		if int64(len(p)) > l.n {
			p = p[:l.n]
		}
	}
	k, err := l.r.Read(p)
	l.n -= int64(k)
	return k, err
}

func (l *headLimiter) limit(on bool) {
	l.limited, l.n, l.exceeded = on, maxCodeHeaderBytes, false
}

// codeConn is one caller's connection of a code tunnel, and the tunnel to
// the interpreter its requests go on.
type codeConn struct {
	n    *Node
	sb   *sandbox
	lg   *trajectory.Log
	sub  string
	conn net.Conn
	lim  *headLimiter
	br   *bufio.Reader
	bw   *bufio.Writer

	up      io.ReadWriteCloser // nil: open one at the next request
	upLim   *headLimiter
	upR     *bufio.Reader
	upW     *bufio.Writer
	closeMu sync.Mutex
	closed  bool
}

func (c *codeConn) setUp(up io.ReadWriteCloser) {
	c.up = up
	c.upLim = &headLimiter{r: up}
	c.upR = bufio.NewReaderSize(c.upLim, 16<<10)
	c.upW = bufio.NewWriterSize(up, 16<<10)
}

func (c *codeConn) dropUp() {
	c.closeMu.Lock()
	defer c.closeMu.Unlock()
	if c.up != nil {
		c.up.Close()
		c.up = nil
	}
}

func (c *codeConn) close() {
	c.closeMu.Lock()
	defer c.closeMu.Unlock()
	if c.closed {
		return
	}
	c.closed = true
	c.conn.Close()
	if c.up != nil {
		c.up.Close()
	}
}

// serveOne serves the caller's next request; false ends the connection.
func (c *codeConn) serveOne() bool {
	c.lim.limit(true)
	req, err := http.ReadRequest(c.br)
	exceeded := c.lim.exceeded
	c.lim.limit(false)
	if err != nil {
		if exceeded {
			c.writeError(errdefs.New(errdefs.ErrResourceExhausted, "the request's head exceeds %d bytes", maxCodeHeaderBytes), http.StatusRequestHeaderFieldsTooLarge)
		} else if !errors.Is(err, io.EOF) && !errors.Is(err, net.ErrClosed) && !errors.Is(err, io.ErrUnexpectedEOF) {
			c.writeError(errdefs.Invalid("request", "%s", err), 0)
		}
		return false
	}
	c.sb.touch()
	defer c.sb.touch()
	if httphdr.HasToken(req.Header, "Connection", "upgrade") {
		c.rawRest(req)
		return false
	}
	if req.Method == http.MethodPost && (strings.TrimRight(req.URL.Path, "/") == "/execute") {
		return c.serveExecute(req)
	}
	return c.forward(req, nil)
}

// writeError answers err in the node's JSON shape and ends the connection.
func (c *codeConn) writeError(err error, status int) {
	code, msg := errdefs.ToHTTP(context.Background(), err)
	if status != 0 {
		code = status
	}
	body, _ := json.Marshal(map[string]any{"code": code, "message": msg, "status": errdefs.Code(err).String()})
	body = append(body, '\n')
	fmt.Fprintf(c.bw, "HTTP/1.1 %d %s\r\nContent-Type: application/json; charset=utf-8\r\nContent-Length: %d\r\nConnection: close\r\n\r\n", code, http.StatusText(code), len(body))
	_, _ = c.bw.Write(body) // a bufio.Writer keeps its first error for Flush
	_ = c.bw.Flush()        // the connection ends either way
}

// roundTrip sends req to the interpreter and reads its answer's head;
// informational answers go on to the caller.
func (c *codeConn) roundTrip(req *http.Request) (*http.Response, <-chan error, error) {
	if c.up == nil {
		up, refused, err := c.n.dialAgentTunnel(c.n.life, c.sb, c.sub)
		if err != nil {
			return nil, nil, err
		}
		if refused != nil {
			b, _ := io.ReadAll(io.LimitReader(refused.Body, 4<<10))
			refused.Body.Close()
			return nil, nil, errdefs.New(errdefs.ErrUnavailable, "the code interpreter of sandbox %s cannot be reached (%d): %s", c.sb.id, refused.StatusCode, strings.TrimSpace(string(b)))
		}
		c.closeMu.Lock()
		closed := c.closed
		c.setUp(up)
		c.closeMu.Unlock()
		if closed {
			up.Close()
			return nil, nil, net.ErrClosed
		}
	}
	sent := make(chan error, 1)
	go func(w *bufio.Writer) {
		err := req.Write(w)
		if err == nil {
			err = w.Flush()
		}
		sent <- err
	}(c.upW)
	for {
		c.upLim.limit(true)
		resp, err := http.ReadResponse(c.upR, req)
		exceeded := c.upLim.exceeded
		c.upLim.limit(false)
		if err != nil {
			c.dropUp()
			if exceeded {
				return nil, nil, errdefs.New(errdefs.ErrResourceExhausted, "the code interpreter's answer head exceeds %d bytes", maxCodeHeaderBytes)
			}
			return nil, nil, errdefs.New(errdefs.ErrUnavailable, "the code interpreter of sandbox %s did not answer: %s", c.sb.id, err)
		}
		if resp.StatusCode >= 100 && resp.StatusCode < 200 && resp.StatusCode != http.StatusSwitchingProtocols {
			if resp.Write(c.bw) != nil || c.bw.Flush() != nil {
				c.dropUp()
				return nil, nil, net.ErrClosed
			}
			continue
		}
		return resp, sent, nil
	}
}

// forward sends req to the interpreter and its answer back, as it comes.
// tap, when set, sees the answer (and may record it); the answer is read
// to its end even when the caller is gone. False ends the connection.
func (c *codeConn) forward(req *http.Request, tap func(*http.Response) io.Reader) bool {
	resp, sent, err := c.roundTrip(req)
	if err != nil {
		if !errors.Is(err, net.ErrClosed) {
			c.writeError(err, http.StatusBadGateway)
		}
		return false
	}
	return c.relay(req, resp, sent, tap)
}

func (c *codeConn) relay(req *http.Request, resp *http.Response, sent <-chan error, tap func(*http.Response) io.Reader) bool {
	upBody := resp.Body
	var body io.Reader = upBody
	if tap != nil {
		body = tap(resp)
	}
	fb := &flushingBody{r: body, bw: c.bw}
	resp.Body = fb
	werr := resp.Write(writerOnly{c.bw})
	if werr == nil {
		werr = c.bw.Flush()
	}
	// The rest of the answer is read whoever listens: a call's end is
	// recorded, and the tunnel stays usable.
	_, rerr := io.Copy(io.Discard, body)
	upBody.Close()
	keepUp := rerr == nil && !resp.Close
	if keepUp {
		// The request went whole before its answer, normally; one the
		// interpreter answered without reading is not waited for.
		select {
		case err := <-sent:
			keepUp = err == nil
		case <-time.After(time.Second):
			keepUp = false
		}
	}
	if !keepUp {
		c.dropUp()
	}
	chunked := slices.Contains(resp.TransferEncoding, "chunked")
	keep := werr == nil && !req.Close && !resp.Close && (chunked || resp.ContentLength >= 0 || req.Method == http.MethodHead)
	return keep && rerr == nil && fb.err == nil
}

// rawRest forwards an upgrade request and splices the rest of the
// connection both ways.
func (c *codeConn) rawRest(req *http.Request) {
	if c.up == nil {
		up, refused, err := c.n.dialAgentTunnel(c.n.life, c.sb, c.sub)
		if err != nil || refused != nil {
			if refused != nil {
				refused.Body.Close()
			}
			c.writeError(errdefs.New(errdefs.ErrUnavailable, "the code interpreter of sandbox %s cannot be reached", c.sb.id), http.StatusBadGateway)
			return
		}
		c.closeMu.Lock()
		c.setUp(up)
		closed := c.closed
		c.closeMu.Unlock()
		if closed {
			up.Close()
			return
		}
	}
	if req.Write(c.upW) != nil || c.upW.Flush() != nil {
		return
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		_, _ = io.Copy(c.up, c.br)
		if cw, ok := c.up.(interface{ CloseWrite() error }); ok {
			_ = cw.CloseWrite()
		}
	}()
	_, _ = io.Copy(writerOnly{c.conn}, c.upR)
	c.close()
	<-done
}

// writerOnly hides a writer's ReadFrom (a bufio.Writer's fills its buffer
// from the reader, which flushes it).
type writerOnly struct{ io.Writer }

// flushingBody flushes what the caller has been written before each read
// of the answer: the head and every part go out as soon as they came.
type flushingBody struct {
	r   io.Reader
	bw  *bufio.Writer
	err error // the caller's write failed
}

func (f *flushingBody) Read(p []byte) (int, error) {
	if f.err == nil && f.bw.Buffered() > 0 {
		if f.err = f.bw.Flush(); f.err != nil {
			// The caller is gone: the answer still goes on to its end.
			return 0, f.err
		}
	}
	return f.r.Read(p)
}

func (f *flushingBody) Close() error { return nil }

// execBody is an /execute request's body.
type execBody struct {
	Code      *string           `json:"code"`
	ContextID string            `json:"context_id"`
	Language  string            `json:"language"`
	EnvVars   map[string]string `json:"env_vars"`
}

// serveExecute serves a POST /execute through the log.
func (c *codeConn) serveExecute(req *http.Request) bool {
	if httphdr.HasToken(req.Header, "Expect", "100-continue") {
		req.Header.Del("Expect")
		if _, err := c.bw.WriteString("HTTP/1.1 100 Continue\r\n\r\n"); err != nil || c.bw.Flush() != nil {
			return false
		}
	}
	raw, err := io.ReadAll(io.LimitReader(req.Body, maxCodeBodyBytes+1))
	req.Body.Close()
	if err != nil {
		return false
	}
	if len(raw) > maxCodeBodyBytes {
		c.writeError(errdefs.New(errdefs.ErrResourceExhausted, "the /execute body exceeds %d bytes; write large code to a file and run it", maxCodeBodyBytes), http.StatusRequestEntityTooLarge)
		return false
	}
	req.Body, req.ContentLength, req.TransferEncoding = io.NopCloser(bytes.NewReader(raw)), int64(len(raw)), nil
	req.Header.Del("Content-Length")
	var eb execBody
	if json.Unmarshal(raw, &eb) != nil || eb.Code == nil {
		// Not an execution the interpreter runs: it refuses it.
		return c.forward(req, nil)
	}
	treq := trajectory.Request{Kind: trajectory.KindCode, Code: *eb.Code, Language: eb.Language, ContextID: eb.ContextID, Env: eb.EnvVars}
	if len(treq.Env) == 0 {
		treq.Env = nil
	}
	var outCap int64
	if v := req.Header.Get(OutputLimitHeader); v != "" {
		k, err := strconv.ParseInt(v, 10, 64)
		if err != nil || k < 0 {
			c.writeError(errdefs.Invalid(OutputLimitHeader, "%q is not a byte count ≥ 0", v), 0)
			return false
		}
		outCap = k
	}
	callID := req.Header.Get(CallIDHeader)
	call, prior, err := c.lg.Begin(callID, treq, outCap)
	if err != nil {
		c.writeError(err, 0)
		return false
	}
	if prior != nil {
		return c.answerPrior(prior)
	}
	seq := call.Seq
	key := pumpKey(c.sb.id, seq)
	c.n.pumps.Store(key, &pump{}) // this node process runs it
	defer c.n.pumps.Delete(key)
	rec := &codeRecorder{lg: c.lg, seq: seq}
	finish := func(r trajectory.Result) {
		if c.n.life.Err() != nil {
			return // node stopping: the next start marks it interrupted
		}
		if _, err := c.lg.Finish(seq, r); err != nil {
			log.G(c.n.life).Warn("record code call end", log.SandboxID(c.sb.id), "seq", seq, log.Err(err))
		}
	}
	resp, sent, err := c.roundTrip(req)
	if err != nil {
		finish(errResult(err))
		if !errors.Is(err, net.ErrClosed) {
			c.writeError(err, http.StatusBadGateway)
		}
		return false
	}
	resp.Header.Set(CallSeqHeader, strconv.FormatUint(seq, 10))
	ok := c.relay(req, resp, sent, func(resp *http.Response) io.Reader {
		rec.status = resp.StatusCode
		return &tapReader{r: resp.Body, rec: rec}
	})
	res := trajectory.Result{HTTPStatus: rec.status}
	switch {
	case rec.err != nil:
		res.ErrCode, res.ErrMsg = "unavailable", "the interpreter's answer ended early: "+rec.err.Error()
	case rec.status == http.StatusOK:
		res.End, res.Status = true, "ok"
		if rec.errName != "" || rec.errSeen {
			res.Status, res.ExitErr = "error", strings.TrimSuffix(rec.errName+": "+rec.errValue, ": ")
		}
	default:
		res.Body = rec.body
	}
	finish(res)
	return ok
}

// answerPrior answers an /execute whose call ID the log has: joined while
// it runs, else replayed.
func (c *codeConn) answerPrior(prior *trajectory.Call) bool {
	seq := prior.Seq
	if prior.State == trajectory.StateRunning {
		if _, live := c.n.pumps.Load(pumpKey(c.sb.id, seq)); !live {
			// Begun by a node process that is gone.
			if _, err := c.lg.Finish(seq, trajectory.Result{Interrupted: true, ErrCode: "failed_precondition",
				ErrMsg: "the node restarted while the code ran; its result was lost and it was not run again"}); err != nil {
				log.G(c.n.life).Warn("record interrupted code call", log.SandboxID(c.sb.id), "seq", seq, log.Err(err))
			}
		}
	}
	// Wait for output or the end: a joined call's answer is 200 only once
	// output came (a refused one has none).
	var cur *trajectory.Call
	for {
		cl, changed := c.lg.Watch(seq)
		if cl == nil {
			c.writeError(errdefs.New(errdefs.ErrNotFound, "call %d is gone from the trajectory log", seq), 0)
			return false
		}
		cur = cl
		if cl.State != trajectory.StateRunning || len(cl.Output) > 0 {
			break
		}
		<-changed
	}
	seqS := strconv.FormatUint(seq, 10)
	if cur.State != trajectory.StateRunning {
		return c.replayCode(cur, seqS)
	}
	// Joined: the recorded lines, then what comes.
	fmt.Fprintf(c.bw, "HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\nTransfer-Encoding: chunked\r\n%s: %s\r\n%s: true\r\n\r\n", CallSeqHeader, seqS, JoinedHeader)
	cw := &chunkWriter{bw: c.bw}
	sent := 0
	for {
		cl, changed := c.lg.Watch(seq)
		if cl == nil {
			return false
		}
		out := codeOutput(cl)
		if cl.State != trajectory.StateRunning && (cl.Truncated || cl.Compacted) {
			out = wholeLines(out)
		}
		if sent < len(out) {
			if cw.write(out[sent:]) != nil {
				return false
			}
			sent = len(out)
		}
		if cl.State != trajectory.StateRunning {
			return cw.end() == nil
		}
		<-changed
	}
}

// replayCode answers a recorded code call as the interpreter did.
func (c *codeConn) replayCode(cl *trajectory.Call, seqS string) bool {
	if cl.HTTPStatus == 0 {
		code := errdefs.ErrUnavailable
		if cl.State == trajectory.StateInterrupted {
			code = errdefs.ErrFailedPrecondition
		}
		c.writeError(errdefs.New(code, "call %d (call_id %q): %s", cl.Seq, cl.CallID, cl.ErrMsg), 0)
		return false
	}
	var body []byte
	ct := "application/x-ndjson"
	extra := ""
	if cl.HTTPStatus == http.StatusOK {
		body = codeOutput(cl)
		if cl.Truncated || cl.Compacted {
			body = wholeLines(body)
			extra = trajectory.OutputTruncatedHeader + ": true\r\n"
		}
	} else {
		body = cl.Body
		ct = "text/plain; charset=utf-8"
		if bytes.HasPrefix(bytes.TrimSpace(body), []byte("{")) {
			ct = "application/json"
		}
	}
	fmt.Fprintf(c.bw, "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n%s: %s\r\n%s: true\r\n%s\r\n",
		cl.HTTPStatus, http.StatusText(cl.HTTPStatus), ct, len(body), CallSeqHeader, seqS, ReplayedHeader, extra)
	_, _ = c.bw.Write(body) // a bufio.Writer keeps its first error for Flush
	return c.bw.Flush() == nil
}

func codeOutput(c *trajectory.Call) []byte {
	var b []byte
	for _, ch := range c.Output {
		b = append(b, ch.Data...)
	}
	return b
}

// wholeLines cuts b after its last newline.
func wholeLines(b []byte) []byte {
	return b[:bytes.LastIndexByte(b, '\n')+1]
}

type chunkWriter struct{ bw *bufio.Writer }

func (w *chunkWriter) write(p []byte) error {
	// A bufio.Writer keeps its first error: Flush reports it.
	_, _ = fmt.Fprintf(w.bw, "%x\r\n", len(p))
	_, _ = w.bw.Write(p)
	_, _ = w.bw.WriteString("\r\n")
	return w.bw.Flush()
}

func (w *chunkWriter) end() error {
	_, _ = w.bw.WriteString("0\r\n\r\n") // its error comes back from Flush
	return w.bw.Flush()
}

// codeRecorder records an /execute's answer: the lines of a 200 as the
// call's output, the error line's name and value, or another answer's
// body.
type codeRecorder struct {
	lg       *trajectory.Log
	seq      uint64
	status   int
	body     []byte
	line     []byte
	long     bool // the current line passed maxCodeErrorLine
	errSeen  bool
	errName  string
	errValue string
	err      error // the answer ended early
}

func (r *codeRecorder) add(p []byte) {
	if r.status != http.StatusOK {
		if room := maxRecordedWriteAnswer - len(r.body); room > 0 {
			r.body = append(r.body, p[:min(room, len(p))]...)
		}
		return
	}
	r.lg.AddOutput(r.seq, trajectory.Stdout, p)
	for len(p) > 0 {
		i := bytes.IndexByte(p, '\n')
		part := p
		if i >= 0 {
			part = p[:i]
		}
		if !r.long {
			if len(r.line)+len(part) > maxCodeErrorLine {
				r.long = true
				if isErrorLine(r.line) || (len(r.line) == 0 && isErrorLine(part)) {
					r.errSeen = true
				}
				r.line = r.line[:0]
			} else {
				r.line = append(r.line, part...)
			}
		}
		if i < 0 {
			return
		}
		if !r.long && isErrorLine(r.line) {
			var ev struct{ Name, Value string }
			if json.Unmarshal(r.line, &ev) == nil {
				r.errSeen, r.errName, r.errValue = true, ev.Name, ev.Value
			}
		}
		r.line, r.long = r.line[:0], false
		p = p[i+1:]
	}
}

// isErrorLine reports whether an interpreter line (its start) is an error
// event.
func isErrorLine(b []byte) bool {
	head := b[:min(len(b), 40)]
	return bytes.Contains(head, []byte(`"type": "error"`)) || bytes.Contains(head, []byte(`"type":"error"`))
}

// tapReader hands what it reads to a codeRecorder.
type tapReader struct {
	r   io.Reader
	rec *codeRecorder
}

func (t *tapReader) Read(p []byte) (int, error) {
	k, err := t.r.Read(p)
	if k > 0 {
		t.rec.add(p[:k])
	}
	if err != nil && err != io.EOF && t.rec.err == nil {
		t.rec.err = err
	}
	return k, err
}
