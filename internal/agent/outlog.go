package agent

import (
	"sort"
	"sync"
	"unsafe"
)

type outKind uint8

const (
	outStdout outKind = iota
	outStderr
	outPTY
)

type outEvent struct {
	off  int64 // bytes appended before this event
	kind outKind
	data []byte
}

// eventCost is what one retained chunk costs besides its data buffer: the
// outEvent itself, twice over for the spare capacity of the events slice.
const eventCost = 2 * int(unsafe.Sizeof(outEvent{}))

// cursor is a reader's position in an outLog: the number of bytes before it.
type cursor struct {
	off int64
}

// outLog is a process's output: a bounded, in-memory sequence of chunks that
// any number of readers consume at their own pace. Small appends of the same
// kind are merged into chunks of up to maxChunk bytes. When the chunks cost
// more than max bytes of memory (data buffers plus bookkeeping) the oldest
// are dropped; a reader that falls behind them learns how many bytes it
// lost. While readers are attached (a client streams the output), a writer
// instead waits for the slowest of them before dropping what it has not
// read, so the process blocks on its full pipe as under envd and a
// streaming client loses nothing; with nobody attached, writers never
// block.
type outLog struct {
	mu     sync.Mutex
	max    int
	events []outEvent // contiguous: each starts where the previous ends
	size   int        // memory cost of events
	total  int64      // bytes ever appended
	closed bool
	// exited: the process ended. Nothing is left to hold back, so writers
	// (draining its pipes) no longer wait for readers; unread output is
	// kept up to 2*max and dropped past it (orphans may keep writing).
	exited  bool
	changed chan struct{}
	// readers are the attached readers' positions; readerMoved is signalled when
	// one advances or detaches.
	readers     map[*outReader]struct{}
	readerMoved *sync.Cond
}

// outReader is an attached reader's position in an outLog.
type outReader struct {
	off int64
}

func newOutLog(max int) *outLog {
	l := &outLog{max: max, changed: make(chan struct{}), readers: map[*outReader]struct{}{}}
	l.readerMoved = sync.NewCond(&l.mu)
	return l
}

// attach registers a reader at c; writers wait for it before dropping
// output it has not read. Call detach when it stops reading.
func (l *outLog) attach(c cursor) *outReader {
	l.mu.Lock()
	defer l.mu.Unlock()
	r := &outReader{off: c.off}
	l.readers[r] = struct{}{}
	return r
}

// advance records that r has read everything before c.
func (l *outLog) advance(r *outReader, c cursor) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if c.off > r.off {
		r.off = c.off
		l.readerMoved.Broadcast()
	}
}

func (l *outLog) detach(r *outReader) {
	l.mu.Lock()
	defer l.mu.Unlock()
	delete(l.readers, r)
	l.readerMoved.Broadcast()
}

// oldestUnread reports whether an attached reader has not yet read all of
// the oldest retained chunk. Callers hold mu.
func (l *outLog) oldestUnread() bool {
	if len(l.events) == 0 {
		return false
	}
	end := l.events[0].off + int64(len(l.events[0].data))
	for r := range l.readers {
		if r.off < end {
			return true
		}
	}
	return false
}

// append adds data to the log and takes ownership of it: the log may append
// to it in place.
func (l *outLog) append(kind outKind, data []byte) {
	if len(data) == 0 {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	// Wait until dropping the oldest chunk to make room would lose nothing
	// an attached reader still has to read.
	for !l.closed && !l.exited && l.size+len(data)+eventCost > l.max && len(l.events) > 1 && l.oldestUnread() {
		l.readerMoved.Wait()
	}
	if l.closed {
		return
	}
	if n := len(l.events); n > 0 && l.events[n-1].kind == kind && len(l.events[n-1].data)+len(data) <= maxChunk {
		// Readers may hold l.events[n-1].data, but only up to its length:
		// growing it in place never changes bytes they can see.
		last := &l.events[n-1]
		before := cap(last.data)
		last.data = append(last.data, data...)
		l.size += cap(last.data) - before
	} else {
		l.events = append(l.events, outEvent{off: l.total, kind: kind, data: data})
		l.size += cap(data) + eventCost
	}
	l.total += int64(len(data))
	// Never drop what an attached reader has not read (the wait above keeps
	// the overshoot to one chunk's growth), until the process exited and
	// more than 2*max is retained.
	for l.size > l.max && len(l.events) > 1 && (!l.oldestUnread() || (l.exited && l.size > 2*l.max)) {
		l.size -= cap(l.events[0].data) + eventCost
		l.events[0] = outEvent{}
		l.events = l.events[1:]
	}
	l.notifyLocked()
}

// processExited stops holding writers back (see exited): what is still in
// the pipes is read at once, so the end follows the exit and is not lost.
func (l *outLog) processExited() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.exited = true
	l.readerMoved.Broadcast()
}

// close marks the end of output; readers drain what is left, then see done.
func (l *outLog) close() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if !l.closed {
		l.closed = true
		l.notifyLocked()
		l.readerMoved.Broadcast()
	}
}

// release drops all retained output (after the process ended and nobody reads).
func (l *outLog) release() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.events = nil
	l.size = 0
	l.readerMoved.Broadcast()
}

func (l *outLog) notifyLocked() {
	close(l.changed)
	l.changed = make(chan struct{})
}

// tail is the cursor just past everything appended so far.
func (l *outLog) tail() cursor {
	l.mu.Lock()
	defer l.mu.Unlock()
	return cursor{off: l.total}
}

// read returns up to limit bytes of events at or after c (at least one event
// if any), the cursor after them, how many bytes were dropped before them
// (c fell behind the retained window), whether the log is closed and fully
// read, and a channel closed on the next change. The first event may be the
// rest of a chunk that c points into.
func (l *outLog) read(c cursor, limit int) (evs []outEvent, next cursor, dropped int64, done bool, wait <-chan struct{}) {
	l.mu.Lock()
	defer l.mu.Unlock()
	next = c
	start := l.total // where the retained window begins
	if len(l.events) > 0 {
		start = l.events[0].off
	}
	if next.off < start {
		dropped = start - next.off
		next.off = start
	}
	// The first event that ends after next.
	i := sort.Search(len(l.events), func(i int) bool {
		e := l.events[i]
		return e.off+int64(len(e.data)) > next.off
	})
	n := 0
	for ; i < len(l.events); i++ {
		e := l.events[i]
		if skip := next.off - e.off; skip > 0 {
			e.data = e.data[skip:]
			e.off = next.off
		}
		if n > 0 && n+len(e.data) > limit {
			break
		}
		e.data = e.data[:len(e.data):len(e.data)] // so no reader appends into the log
		evs = append(evs, e)
		n += len(e.data)
		next.off = e.off + int64(len(e.data))
	}
	done = l.closed && next.off == l.total
	return evs, next, dropped, done, l.changed
}
