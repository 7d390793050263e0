package vmchan

import (
	"encoding/binary"
	"errors"
	"io"
	"sync"
)

// The guest cannot tell one host connection from the next: QEMU's chardev
// socket takes a new client, and the guest's port reads on without an end
// of file when the old client left while the guest was paused, restored
// from a snapshot, or just slow to look. A new host session then meets the
// guest's old yamux session, whose streams and IDs are the old host's:
// requests hang or break. portSplitter watches the frame headers on the
// port and ends the guest's session where a new host session begins: the
// SYN of stream 1 (a yamux client's first stream) after other frames.
// That frame is the first of the guest's next session.

// yamux frame header: version, type, flags, stream ID, length.
const (
	hdrLen        = 12
	typeData      = 0
	typeWindowUpd = 1
	flagSYN       = 1
)

type portSplitter struct {
	rw io.ReadWriteCloser

	mu   sync.Mutex
	buf  []byte // read from the port, not yet given to a session
	free int    // bytes at the start of buf that belong to the current session
	gen  int    // the current session's number
	seen int    // frames in the current session
	err  error  // the port's read error
}

// session is the port as seen by one guest yamux session.
type session struct {
	p   *portSplitter
	gen int
}

func (p *portSplitter) next() *session {
	p.mu.Lock()
	defer p.mu.Unlock()
	return &session{p: p, gen: p.gen}
}

var errSessionSplit = errors.New("vmchan: a new host session began")

func (s *session) Read(b []byte) (int, error) {
	p := s.p
	p.mu.Lock()
	defer p.mu.Unlock()
	for {
		if s.gen != p.gen {
			return 0, io.EOF
		}
		if p.free > 0 {
			if len(p.buf) == 0 {
				if p.err != nil {
					return 0, p.err
				}
				p.readMore()
				continue
			}
			n := copy(b, p.buf[:min(p.free, len(p.buf))])
			p.buf = p.buf[n:]
			p.free -= n
			return n, nil
		}
		if len(p.buf) >= hdrLen {
			h := p.buf[:hdrLen]
			typ, flags, stream := h[1], binary.BigEndian.Uint16(h[2:4]), binary.BigEndian.Uint32(h[4:8])
			if h[0] == 0 && (typ == typeData || typ == typeWindowUpd) && flags&flagSYN != 0 && stream == 1 && p.seen > 0 {
				p.gen++
				p.seen = 0
				return 0, io.EOF
			}
			p.seen++
			p.free = hdrLen
			if h[0] == 0 && typ == typeData {
				p.free += int(binary.BigEndian.Uint32(h[8:12]))
			}
			continue
		}
		if p.err != nil {
			if len(p.buf) > 0 {
				// A partial header before the end: give it as it is.
				p.free = len(p.buf)
				continue
			}
			return 0, p.err
		}
		p.readMore()
	}
}

// readMore reads from the port into buf (p.mu held; released meanwhile).
func (p *portSplitter) readMore() {
	tmp := make([]byte, 32<<10)
	p.mu.Unlock()
	n, err := p.rw.Read(tmp)
	p.mu.Lock()
	p.buf = append(p.buf, tmp[:n]...)
	if err != nil {
		p.err = err
	}
}

func (s *session) Write(b []byte) (int, error) {
	p := s.p
	p.mu.Lock()
	stale := s.gen != p.gen
	p.mu.Unlock()
	if stale {
		return 0, errSessionSplit
	}
	return p.rw.Write(b)
}

// Close ends this session's use of the port; the port stays open.
func (s *session) Close() error { return nil }
