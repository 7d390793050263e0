package agent

import "sync"

type outKind uint8

const (
	outStdout outKind = iota
	outStderr
	outPTY
)

type outEvent struct {
	seq  uint64
	off  int64 // bytes appended before this event
	kind outKind
	data []byte
}

// cursor is a reader's position in an outLog.
type cursor struct {
	seq uint64
	off int64
}

// outLog is a process's output: a bounded, in-memory sequence of chunks that
// any number of readers consume at their own pace. When it holds more than
// max bytes the oldest chunks are dropped; a reader that falls behind them
// learns how many bytes it lost. Writers never block on readers.
type outLog struct {
	mu      sync.Mutex
	max     int
	events  []outEvent
	size    int
	next    uint64 // seq of the next appended event
	total   int64  // bytes ever appended
	closed  bool
	changed chan struct{}
}

func newOutLog(max int) *outLog {
	return &outLog{max: max, changed: make(chan struct{})}
}

func (l *outLog) append(kind outKind, data []byte) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return
	}
	l.events = append(l.events, outEvent{seq: l.next, off: l.total, kind: kind, data: data})
	l.next++
	l.total += int64(len(data))
	l.size += len(data)
	for l.size > l.max && len(l.events) > 1 {
		l.size -= len(l.events[0].data)
		l.events[0] = outEvent{}
		l.events = l.events[1:]
	}
	l.notifyLocked()
}

// close marks the end of output; readers drain what is left, then see done.
func (l *outLog) close() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if !l.closed {
		l.closed = true
		l.notifyLocked()
	}
}

// release drops all retained output (after the process ended and nobody reads).
func (l *outLog) release() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.events = nil
	l.size = 0
}

func (l *outLog) notifyLocked() {
	close(l.changed)
	l.changed = make(chan struct{})
}

// tail is the cursor just past everything appended so far.
func (l *outLog) tail() cursor {
	l.mu.Lock()
	defer l.mu.Unlock()
	return cursor{seq: l.next, off: l.total}
}

// read returns up to limit bytes of events at or after c, the cursor after
// them, how many bytes were dropped before them (c fell behind the retained
// window), whether the log is closed and fully read, and a channel closed on
// the next change.
func (l *outLog) read(c cursor, limit int) (evs []outEvent, next cursor, dropped int64, done bool, wait <-chan struct{}) {
	l.mu.Lock()
	defer l.mu.Unlock()
	next = c
	if len(l.events) == 0 {
		if c.seq < l.next {
			dropped = l.total - c.off
			next = cursor{seq: l.next, off: l.total}
		}
		return nil, next, dropped, l.closed, l.changed
	}
	first := l.events[0]
	if c.seq < first.seq {
		dropped = first.off - c.off
		next = cursor{seq: first.seq, off: first.off}
	}
	n := 0
	for i := int(next.seq - first.seq); i < len(l.events); i++ {
		e := l.events[i]
		if n > 0 && n+len(e.data) > limit {
			break
		}
		evs = append(evs, e)
		n += len(e.data)
		next = cursor{seq: e.seq + 1, off: e.off + int64(len(e.data))}
	}
	done = l.closed && next.seq == l.next
	return evs, next, dropped, done, l.changed
}
