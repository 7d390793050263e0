package trajectory

import (
	"bufio"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/kernflux/opendsec/internal/errdefs"
)

// Defaults for Options left zero.
const (
	// DefaultMaxBytes bounds one sandbox's log file
	// (node.trajectory.max_log_mb).
	DefaultMaxBytes = 64 << 20
	// DefaultMaxOutputBytes bounds the recorded output of one stream of
	// one call (node.trajectory.max_output_kb).
	DefaultMaxOutputBytes = 1 << 20
	// DefaultRetention is how long a stopped sandbox's log is kept
	// (node.trajectory.retention_sec).
	DefaultRetention = 24 * time.Hour
	// maxFrame bounds one entry: the largest call with both streams at
	// the output cap, base64'd, is far smaller.
	maxFrame = 256 << 20
)

// Options configures a Store.
type Options struct {
	// Dir holds one <sandbox-id>.log per sandbox.
	Dir string
	// MaxBytes bounds a log's file: past it the oldest calls' output is
	// dropped. Zero means DefaultMaxBytes.
	MaxBytes int64
	// MaxOutputBytes bounds the recorded output of each stream of a
	// call. Zero means DefaultMaxOutputBytes.
	MaxOutputBytes int64
	// Retention is how long the log of a stopped sandbox is kept. Zero
	// means DefaultRetention; negative removes it at the stop.
	Retention time.Duration
	// Sync makes every begin and end durable (fdatasync) before the call
	// goes on. Without it the entries are written (they survive a kill
	// of the node, not a crash of the machine).
	Sync bool
	// Clock is the time source (nil: time.Now).
	Clock func() time.Time
}

// Store holds the logs of a node's sandboxes.
type Store struct {
	opts Options
	mu   sync.Mutex
	logs map[string]*Log // open logs; guarded by mu
}

// Open opens (making it if needed) the store's directory.
func Open(opts Options) (*Store, error) {
	if opts.MaxBytes <= 0 {
		opts.MaxBytes = DefaultMaxBytes
	}
	if opts.MaxOutputBytes <= 0 {
		opts.MaxOutputBytes = DefaultMaxOutputBytes
	}
	if opts.Retention == 0 {
		opts.Retention = DefaultRetention
	}
	if opts.Clock == nil {
		opts.Clock = time.Now
	}
	if err := os.MkdirAll(opts.Dir, 0o700); err != nil {
		return nil, fmt.Errorf("make trajectory dir: %w", err)
	}
	return &Store{opts: opts, logs: map[string]*Log{}}, nil
}

// Options returns the store's options with defaults applied.
func (s *Store) Options() Options { return s.opts }

func (s *Store) path(id string) string { return filepath.Join(s.opts.Dir, id+".log") }

func validID(id string) error {
	if id == "" || strings.ContainsAny(id, "/\\.") || len(id) > 128 {
		return errdefs.Invalid("sandbox_id", "%q is not a sandbox ID", id)
	}
	return nil
}

// Log returns sandbox id's open log, loading it, or making it headed by
// init (its SandboxID and Created are set here).
func (s *Store) Log(id string, init Meta) (*Log, error) {
	if err := validID(id); err != nil {
		return nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if l, ok := s.logs[id]; ok {
		return l, nil
	}
	init.SandboxID, init.Created = id, s.opts.Clock()
	l, err := s.openLocked(id, init)
	if err != nil {
		return nil, err
	}
	s.logs[id] = l
	return l, nil
}

// openLocked loads id's file, or makes it headed by meta.
func (s *Store) openLocked(id string, meta Meta) (*Log, error) {
	l := &Log{store: s, id: id, byID: map[string]*Call{}, bySeq: map[uint64]*Call{}, changed: map[uint64]chan struct{}{}}
	f, err := os.OpenFile(s.path(id), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("open trajectory log: %w", err)
	}
	l.f = f
	good, err := l.load(f)
	if err != nil {
		f.Close()
		return nil, err
	}
	// Cut a torn or corrupt tail (a write the machine's crash cut short).
	if err := f.Truncate(good); err != nil {
		f.Close()
		return nil, fmt.Errorf("truncate trajectory log: %w", err)
	}
	if _, err := f.Seek(good, io.SeekStart); err != nil {
		f.Close()
		return nil, fmt.Errorf("seek trajectory log: %w", err)
	}
	l.size = good
	if good == 0 {
		l.meta = meta
		if err := l.appendLocked(entry{Meta: &l.meta}, true); err != nil {
			f.Close()
			return nil, err
		}
	}
	return l, nil
}

// Read returns sandbox id's log: its meta and calls in order. It reads
// the file of a sandbox that stopped.
func (s *Store) Read(id string) (Meta, []*Call, error) {
	if err := validID(id); err != nil {
		return Meta{}, nil, err
	}
	s.mu.Lock()
	l, ok := s.logs[id]
	s.mu.Unlock()
	if ok {
		return l.Meta(), l.Calls(), nil
	}
	f, err := os.Open(s.path(id))
	if errors.Is(err, fs.ErrNotExist) {
		return Meta{}, nil, errdefs.New(errdefs.ErrNotFound, "no trajectory log for sandbox %s (it never ran a call on this node, or its log passed node.trajectory.retention_sec after its stop)", id)
	}
	if err != nil {
		return Meta{}, nil, fmt.Errorf("open trajectory log: %w", err)
	}
	defer f.Close()
	r := &Log{id: id, byID: map[string]*Call{}, bySeq: map[uint64]*Call{}}
	if _, err := r.load(f); err != nil {
		return Meta{}, nil, err
	}
	return r.meta, r.calls, nil
}

// Fork starts child's log with parent's calls: those that ended, and
// those still running marked interrupted (the child does not have their
// processes). Each keeps its sequence number and names the sandbox it ran
// in. A child that already has a log keeps it (a repeated fork).
func (s *Store) Fork(parent, child string, init Meta) error {
	if err := validID(child); err != nil {
		return err
	}
	_, calls, err := s.Read(parent)
	if errdefs.IsNotFound(err) {
		calls = nil
	} else if err != nil {
		return err
	}
	return s.startFrom(parent, calls, child, init, "forked")
}

// Export writes sandbox id's log as it is now to a new file at path (a
// snapshot's copy of it, which Restore starts other logs from): its head
// names id, and calls still running are marked interrupted, as a fork
// marks them. The file is written whole (temporary file, fsync, rename)
// or not at all. A sandbox without a log exports an empty one.
func (s *Store) Export(id, path string) error {
	if err := validID(id); err != nil {
		return err
	}
	meta, calls, err := s.Read(id)
	if errdefs.IsNotFound(err) {
		meta, calls = Meta{SandboxID: id, Created: s.opts.Clock()}, nil
	} else if err != nil {
		return err
	}
	meta.Closed = time.Time{}
	for i, c := range calls {
		if c.Origin == "" {
			c.Origin = id
		}
		if c.State == StateRunning {
			c.State = StateInterrupted
			c.ErrCode = "aborted"
			c.ErrMsg = "the call was running in sandbox " + c.Origin + " when it was snapshotted; sandboxes started from the snapshot did not run it"
		}
		calls[i] = c
	}
	return writeLogFile(path, meta, calls)
}

// writeLogFile writes a log file of meta and calls at path atomically.
func writeLogFile(path string, meta Meta, calls []*Call) error {
	tmp := path + ".tmp"
	f, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return fmt.Errorf("write trajectory copy: %w", err)
	}
	w := bufio.NewWriterSize(f, 256<<10)
	write := func(e entry) error {
		b, err := frame(e)
		if err == nil {
			_, err = w.Write(b)
		}
		return err
	}
	err = write(entry{Meta: &meta})
	for _, c := range calls {
		if err != nil {
			break
		}
		err = write(entry{Call: c})
	}
	if err == nil {
		err = w.Flush()
	}
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err != nil {
		os.Remove(tmp)
		return fmt.Errorf("write trajectory copy: %w", err)
	}
	return nil
}

// ReadFile reads a log file written by Export (or any log file).
func ReadFile(path string) (Meta, []*Call, error) {
	f, err := os.Open(path)
	if err != nil {
		return Meta{}, nil, fmt.Errorf("open trajectory copy: %w", err)
	}
	defer f.Close()
	r := &Log{byID: map[string]*Call{}, bySeq: map[uint64]*Call{}}
	if _, err := r.load(f); err != nil {
		return Meta{}, nil, err
	}
	return r.meta, r.calls, nil
}

// Restore starts child's log with the calls of the log file at path (a
// snapshot's, from Export), its parent the sandbox the file was exported
// from: as Fork, but from a copy that may come from another node. A child
// that already has a log keeps it.
func (s *Store) Restore(path, child string, init Meta) error {
	if err := validID(child); err != nil {
		return err
	}
	meta, calls, err := ReadFile(path)
	if err != nil {
		return err
	}
	if meta.SandboxID == "" {
		return fmt.Errorf("trajectory copy %s has no head", path)
	}
	return s.startFrom(meta.SandboxID, calls, child, init, "snapshotted")
}

// startFrom makes child's log, headed by init with parent as its parent,
// starting with calls (see Fork); how says what the parent went through
// (for calls still running: the child did not run them).
func (s *Store) startFrom(parent string, calls []*Call, child string, init Meta, how string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.logs[child]; ok {
		return nil
	}
	if _, err := os.Stat(s.path(child)); err == nil {
		return nil
	}
	m := init
	m.SandboxID, m.ParentID, m.Created = child, parent, s.opts.Clock()
	if len(calls) > 0 {
		m.ForkSeq = calls[len(calls)-1].Seq
	}
	l, err := s.openLocked(child, m)
	if err != nil {
		return err
	}
	for _, c := range calls {
		c = c.clone()
		if c.Origin == "" {
			c.Origin = parent
		}
		if c.State == StateRunning {
			c.State = StateInterrupted
			c.ErrCode = "aborted"
			c.ErrMsg = "the call was running in sandbox " + c.Origin + " when it was " + how + "; this sandbox did not run it"
		}
		l.addLocked(c)
		if err := l.appendLocked(entry{Call: c}, false); err != nil {
			l.f.Close()
			return err
		}
	}
	if s.opts.Sync {
		if err := l.f.Sync(); err != nil {
			l.f.Close()
			return fmt.Errorf("sync trajectory log: %w", err)
		}
	}
	s.logs[child] = l
	return nil
}

// Close marks sandbox id's log stopped and closes its file; the file stays
// until Sweep passes its retention (or goes at once with a negative one).
func (s *Store) Close(id string) error {
	s.mu.Lock()
	l, ok := s.logs[id]
	delete(s.logs, id)
	if !ok && s.opts.Retention >= 0 && validID(id) == nil {
		// A log not opened since the node restarted: its stop is stamped
		// too, so that its retention counts from the stop, not from its
		// last call.
		if _, err := os.Stat(s.path(id)); err == nil {
			var oerr error
			if l, oerr = s.openLocked(id, Meta{SandboxID: id, Created: s.opts.Clock()}); oerr != nil {
				s.mu.Unlock()
				return oerr
			}
			ok = true
		}
	}
	s.mu.Unlock()
	if !ok {
		if s.opts.Retention < 0 {
			return s.Remove(id)
		}
		return nil
	}
	l.mu.Lock()
	l.meta.Closed = s.opts.Clock()
	err := l.appendLocked(entry{Meta: &l.meta}, false)
	l.closed = true
	for seq, ch := range l.changed {
		close(ch)
		delete(l.changed, seq)
	}
	cerr := l.f.Close()
	l.mu.Unlock()
	if s.opts.Retention < 0 {
		return s.Remove(id)
	}
	return errors.Join(err, cerr)
}

// Remove deletes sandbox id's log.
func (s *Store) Remove(id string) error {
	s.mu.Lock()
	l, ok := s.logs[id]
	delete(s.logs, id)
	s.mu.Unlock()
	if ok {
		l.mu.Lock()
		l.closed = true
		l.f.Close()
		l.mu.Unlock()
	}
	if err := os.Remove(s.path(id)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("remove trajectory log: %w", err)
	}
	return nil
}

// Sweep removes the logs of sandboxes that are not open and not live
// whose last write is older than the retention. It returns how many went.
func (s *Store) Sweep(live func(id string) bool) (int, error) {
	ents, err := os.ReadDir(s.opts.Dir)
	if err != nil {
		return 0, fmt.Errorf("read trajectory dir: %w", err)
	}
	cut := s.opts.Clock().Add(-max(s.opts.Retention, 0))
	n := 0
	var errs []error
	for _, e := range ents {
		id, ok := strings.CutSuffix(e.Name(), ".log")
		if !ok || validID(id) != nil {
			continue
		}
		s.mu.Lock()
		_, open := s.logs[id]
		s.mu.Unlock()
		if open || live(id) {
			continue
		}
		info, err := e.Info()
		if err != nil || info.ModTime().After(cut) {
			continue
		}
		if err := os.Remove(filepath.Join(s.opts.Dir, e.Name())); err != nil && !errors.Is(err, fs.ErrNotExist) {
			errs = append(errs, err)
			continue
		}
		n++
	}
	return n, errors.Join(errs...)
}

// entry is one frame's payload.
type entry struct {
	Meta *Meta `json:"m,omitempty"`
	Call *Call `json:"c,omitempty"`
}

var crcTable = crc32.MakeTable(crc32.Castagnoli)

func frame(e entry) ([]byte, error) {
	payload, err := json.Marshal(e)
	if err != nil {
		return nil, fmt.Errorf("encode trajectory entry: %w", err)
	}
	b := make([]byte, 8, 8+len(payload))
	binary.BigEndian.PutUint32(b[0:4], uint32(len(payload)))
	binary.BigEndian.PutUint32(b[4:8], crc32.Checksum(payload, crcTable))
	return append(b, payload...), nil
}

// load reads every whole, intact frame of r into l and returns the offset
// after the last one.
func (l *Log) load(r io.Reader) (int64, error) {
	br := bufio.NewReaderSize(r, 64<<10)
	var off int64
	var hdr [8]byte
	for {
		if _, err := io.ReadFull(br, hdr[:]); err != nil {
			return off, nil // EOF or a torn header
		}
		n := binary.BigEndian.Uint32(hdr[0:4])
		if n > maxFrame {
			return off, nil
		}
		payload := make([]byte, n)
		if _, err := io.ReadFull(br, payload); err != nil {
			return off, nil
		}
		if crc32.Checksum(payload, crcTable) != binary.BigEndian.Uint32(hdr[4:8]) {
			return off, nil
		}
		var e entry
		if err := json.Unmarshal(payload, &e); err != nil {
			return off, nil
		}
		switch {
		case e.Meta != nil:
			l.meta = *e.Meta
		case e.Call != nil:
			l.addLocked(e.Call)
		}
		off += 8 + int64(n)
	}
}

// Log is one sandbox's log.
type Log struct {
	store *Store
	id    string

	mu     sync.Mutex
	f      *os.File
	size   int64
	meta   Meta
	calls  []*Call // by seq
	byID   map[string]*Call
	bySeq  map[uint64]*Call
	closed bool
	// changed[seq] is closed when call seq changes (Watch).
	changed map[uint64]chan struct{}
	// caps of running calls: their output cap per stream.
	caps map[uint64]int64
}

// addLocked upserts c.
func (l *Log) addLocked(c *Call) {
	if old, ok := l.bySeq[c.Seq]; ok {
		*old = *c
		c = old
	} else {
		l.bySeq[c.Seq] = c
		i, _ := slices.BinarySearchFunc(l.calls, c.Seq, func(a *Call, s uint64) int { return cmpU(a.Seq, s) })
		l.calls = slices.Insert(l.calls, i, c)
	}
	if c.CallID != "" {
		l.byID[c.CallID] = c
	}
}

func cmpU(a, b uint64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// appendLocked writes e at the log's end, syncing it when sync and the
// store asks for it.
func (l *Log) appendLocked(e entry, sync bool) error {
	if l.closed {
		return errdefs.New(errdefs.ErrFailedPrecondition, "the trajectory log of sandbox %s is closed: the sandbox stopped", l.id)
	}
	b, err := frame(e)
	if err != nil {
		return err
	}
	if _, err := l.f.Write(b); err != nil {
		return fmt.Errorf("write trajectory log: %w", err)
	}
	l.size += int64(len(b))
	if sync && l.store != nil && l.store.opts.Sync {
		if err := l.f.Sync(); err != nil {
			return fmt.Errorf("sync trajectory log: %w", err)
		}
	}
	return nil
}

// notifyLocked wakes Watch-ers of seq.
func (l *Log) notifyLocked(seq uint64) {
	if ch, ok := l.changed[seq]; ok {
		close(ch)
		delete(l.changed, seq)
	}
}

// Meta returns the log's head.
func (l *Log) Meta() Meta {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.meta
}

// Calls returns a copy of every call in order.
func (l *Log) Calls() []*Call {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := make([]*Call, len(l.calls))
	for i, c := range l.calls {
		out[i] = c.clone()
	}
	return out
}

// Running returns the calls still running.
func (l *Log) Running() []*Call {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []*Call
	for _, c := range l.calls {
		if c.State == StateRunning {
			out = append(out, c.clone())
		}
	}
	return out
}

// Find returns the call with callID, or nil.
func (l *Log) Find(callID string) *Call {
	l.mu.Lock()
	defer l.mu.Unlock()
	if c, ok := l.byID[callID]; ok {
		return c.clone()
	}
	return nil
}

// MismatchError is a call ID reused with another request.
type MismatchError struct {
	CallID        string
	Seq           uint64
	Recorded, New Request
}

func (e *MismatchError) Error() string {
	return fmt.Sprintf("call_id %q is call %d of this sandbox's trajectory, %s; this call is %s: a call ID names one request — give a different request its own call_id",
		e.CallID, e.Seq, e.Recorded, e.New)
}

// Unwrap makes a MismatchError a failed precondition.
func (e *MismatchError) Unwrap() error { return errdefs.ErrFailedPrecondition }

// Begin records a new call and returns it, written before it returns (so
// before the caller starts anything). A callID already in the log returns
// that call instead (prior, with c nil), or a *MismatchError when its
// request differs. outputCap bounds the recorded output of each stream (0:
// the store's cap; never above it).
func (l *Log) Begin(callID string, req Request, outputCap int64) (c, prior *Call, err error) {
	if err := ValidateCallID(callID); err != nil {
		return nil, nil, err
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if callID != "" {
		if p, ok := l.byID[callID]; ok {
			if !p.Req.Same(req) {
				return nil, nil, &MismatchError{CallID: callID, Seq: p.Seq, Recorded: p.Req, New: req}
			}
			return nil, p.clone(), nil
		}
	}
	var seq uint64 = 1
	if n := len(l.calls); n > 0 {
		seq = l.calls[n-1].Seq + 1
	}
	c = &Call{Seq: seq, CallID: callID, State: StateRunning, Req: req, Started: l.store.opts.Clock().UTC()}
	if err := l.appendLocked(entry{Call: c}, true); err != nil {
		return nil, nil, err
	}
	l.addLocked(c)
	if l.caps == nil {
		l.caps = map[uint64]int64{}
	}
	limit := l.store.opts.MaxOutputBytes
	if outputCap > 0 {
		limit = min(limit, outputCap)
	}
	l.caps[seq] = limit
	return c.clone(), nil, nil
}

// SetPid records the process a running call started.
func (l *Log) SetPid(seq uint64, pid uint32) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	c, ok := l.bySeq[seq]
	if !ok || c.State != StateRunning {
		return nil
	}
	c.Pid = pid
	defer l.notifyLocked(seq)
	cc := *c
	cc.Output = nil // the output is written with the end
	return l.appendLocked(entry{Call: &cc}, false)
}

// AddOutput adds output of a running call, up to its cap per stream
// (stdout and PTY output count together); past it the call is marked
// truncated and the bytes only counted.
func (l *Log) AddOutput(seq uint64, stream string, data []byte) {
	if len(data) == 0 {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	c, ok := l.bySeq[seq]
	if !ok || c.State != StateRunning {
		return
	}
	limit := l.caps[seq]
	if limit == 0 {
		limit = l.store.opts.MaxOutputBytes
	}
	total := &c.StdoutBytes
	if stream == Stderr {
		total = &c.StderrBytes
	}
	before := *total
	*total += int64(len(data))
	room := limit - before
	if room < int64(len(data)) {
		c.Truncated = true
		data = data[:max(room, 0)]
	}
	if len(data) == 0 {
		return
	}
	if n := len(c.Output); n > 0 && c.Output[n-1].Stream == stream {
		c.Output[n-1].Data = append(c.Output[n-1].Data, data...)
	} else {
		c.Output = append(c.Output, Chunk{Stream: stream, Data: slices.Clone(data)})
	}
	l.notifyLocked(seq)
}

// Finish records how a running call ended, written before it returns;
// then, when the file passed its bound, compacts the log.
func (l *Log) Finish(seq uint64, r Result) (*Call, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	c, ok := l.bySeq[seq]
	if !ok {
		return nil, errdefs.New(errdefs.ErrNotFound, "call %d is not in the trajectory log of sandbox %s", seq, l.id)
	}
	if c.State != StateRunning {
		return c.clone(), nil
	}
	c.State = StateDone
	if r.Interrupted {
		c.State = StateInterrupted
	}
	c.Ended = l.store.opts.Clock().UTC()
	c.Exited, c.ExitCode, c.Status, c.ExitErr = r.Exited, r.ExitCode, r.Status, r.ExitErr
	c.End, c.ErrCode, c.ErrMsg = r.End, r.ErrCode, r.ErrMsg
	c.HTTPStatus, c.Body = r.HTTPStatus, r.Body
	if r.OutputLost {
		c.Truncated = true
	}
	if r.SHA256 != "" {
		c.Req.SHA256, c.Req.Size = r.SHA256, r.Size
	}
	if len(r.Files) > 0 {
		c.Req.Files = r.Files
	}
	delete(l.caps, seq)
	defer l.notifyLocked(seq)
	if err := l.appendLocked(entry{Call: c}, true); err != nil {
		return c.clone(), err
	}
	if l.size > l.store.opts.MaxBytes {
		if err := l.compactLocked(); err != nil {
			return c.clone(), err
		}
	}
	return c.clone(), nil
}

// Watch returns call seq as it is now and a channel closed at its next
// change (output, pid, end) or when the log closes.
func (l *Log) Watch(seq uint64) (*Call, <-chan struct{}) {
	l.mu.Lock()
	defer l.mu.Unlock()
	c, ok := l.bySeq[seq]
	if !ok || l.closed {
		ch := make(chan struct{})
		close(ch)
		if !ok {
			return nil, ch
		}
		return c.clone(), ch
	}
	ch, ok := l.changed[seq]
	if !ok {
		ch = make(chan struct{})
		l.changed[seq] = ch
	}
	return c.clone(), ch
}

// Size is the log file's size in bytes.
func (l *Log) Size() int64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.size
}

// compactLocked rewrites the log with one entry per call, dropping the
// output of the oldest ended calls until the file is under half its bound.
// The rewrite goes to a temporary file renamed over the log, so a crash
// leaves the old log or the new one.
func (l *Log) compactLocked() error {
	limit := l.store.opts.MaxBytes / 2
	var total int64
	for _, c := range l.calls {
		total += 8 + 256 + c.outputSize()*4/3 + int64(len(c.Req.String()))
	}
	for _, c := range l.calls {
		if total <= limit {
			break
		}
		if c.State == StateRunning || c.outputSize() == 0 {
			continue
		}
		total -= c.outputSize() * 4 / 3
		c.Output, c.Body = nil, nil
		c.Compacted = true
	}
	tmp := l.store.path(l.id) + ".compact"
	f, err := os.OpenFile(tmp, os.O_RDWR|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return fmt.Errorf("compact trajectory log: %w", err)
	}
	w := bufio.NewWriterSize(f, 256<<10)
	var size int64
	write := func(e entry) error {
		b, err := frame(e)
		if err != nil {
			return err
		}
		size += int64(len(b))
		_, err = w.Write(b)
		return err
	}
	err = write(entry{Meta: &l.meta})
	for _, c := range l.calls {
		if err != nil {
			break
		}
		err = write(entry{Call: c})
	}
	if err == nil {
		err = w.Flush()
	}
	if err == nil && l.store.opts.Sync {
		err = f.Sync()
	}
	if err == nil {
		err = os.Rename(tmp, l.store.path(l.id))
	}
	if err != nil {
		f.Close()
		os.Remove(tmp)
		return fmt.Errorf("compact trajectory log: %w", err)
	}
	l.f.Close()
	l.f = f
	l.size = size
	return nil
}
