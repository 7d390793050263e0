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
// host's hello (a ping with the flags flagHello and a random value, see
// hello) after other frames, or, from a host without a hello, the SYN of
// stream 1 (a yamux client's first stream) after other frames. That frame
// is the first of the guest's next session. The splitter answers the hello
// itself (a ping with ACK|RST and the same value) before the new session
// writes anything; yamux never sees it.
//
// The other way round, what the old session wrote before it ended may
// still be on its way to the new host, with the new host's stream IDs:
// the host skips every frame until the answer to its hello. For the host
// to skip whole frames, the port's output stays framed: writes are
// serialized, and a frame an old session left half-written is padded with
// zeros before the next session writes.

// yamux frame header: version, type, flags, stream ID, length.
const (
	hdrLen        = 12
	typeData      = 0
	typeWindowUpd = 1
	typePing      = 2
	flagSYN       = 1
	flagACK       = 2
	flagRST       = 8
	// flagHello marks the host's hello ping: SYN (so yamux answers it with
	// an ACK of the same value) and RST, which no yamux ping carries.
	flagHello = flagSYN | flagRST
)

type portSplitter struct {
	rw io.ReadWriteCloser

	mu    sync.Mutex
	buf   []byte // read from the port, not yet given to a session
	free  int    // bytes at the start of buf that belong to the current session
	gen   int    // the current session's number
	seen  int    // frames in the current session
	hello bool   // the current session began with a host's hello
	err   error  // the port's read error

	wmu  sync.Mutex // serializes writes to the port
	wgen int        // the session whose frame is being written
	wout frameTracker
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

// frame is a yamux frame header without a body.
func frame(typ byte, flags uint16, stream, length uint32) []byte {
	h := make([]byte, hdrLen)
	h[1] = typ
	binary.BigEndian.PutUint16(h[2:4], flags)
	binary.BigEndian.PutUint32(h[4:8], stream)
	binary.BigEndian.PutUint32(h[8:12], length)
	return h
}

// isHello says whether the header h is a host's hello.
func isHello(h []byte) bool {
	return h[0] == 0 && h[1] == typePing && binary.BigEndian.Uint16(h[2:4]) == flagHello
}

// isFirstStream says whether the header h opens stream 1.
func isFirstStream(h []byte) bool {
	typ, flags, stream := h[1], binary.BigEndian.Uint16(h[2:4]), binary.BigEndian.Uint32(h[4:8])
	return h[0] == 0 && (typ == typeData || typ == typeWindowUpd) && flags&flagSYN != 0 && stream == 1
}

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
			hello := isHello(h)
			if p.seen > 0 && (hello || !p.hello && isFirstStream(h)) {
				p.gen++
				p.seen = 0
				return 0, io.EOF
			}
			if hello {
				// The hello is the splitter's, not yamux's: answered here,
				// before anything of this session is written.
				answer := frame(typePing, flagACK|flagRST, 0, binary.BigEndian.Uint32(h[8:12]))
				p.buf = p.buf[hdrLen:]
				p.seen, p.hello = 1, true
				p.mu.Unlock()
				_, err := s.Write(answer)
				p.mu.Lock()
				if err != nil {
					return 0, err
				}
				continue
			}
			if p.seen == 0 {
				p.hello = false
			}
			p.seen++
			p.free = hdrLen
			if h[0] == 0 && h[1] == typeData {
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
	p.wmu.Lock()
	defer p.wmu.Unlock()
	p.mu.Lock()
	stale := s.gen != p.gen
	p.mu.Unlock()
	if stale {
		return 0, errSessionSplit
	}
	if p.wgen != s.gen {
		// The port's last frame may be an old session's, half-written.
		if err := p.wout.finish(p.rw); err != nil {
			return 0, err
		}
		p.wgen = s.gen
	}
	n, err := p.rw.Write(b)
	p.wout.track(b[:n])
	return n, err
}

// Close ends this session's use of the port; the port stays open.
func (s *session) Close() error { return nil }

// frameTracker follows the yamux frames in a byte stream as it is written.
type frameTracker struct {
	hdr  [hdrLen]byte
	have int // header bytes seen of the current frame
	body int // body bytes the current frame still has to come
}

func (f *frameTracker) track(b []byte) {
	for len(b) > 0 {
		if f.body > 0 {
			n := min(f.body, len(b))
			f.body -= n
			b = b[n:]
			continue
		}
		n := copy(f.hdr[f.have:], b)
		f.have += n
		b = b[n:]
		if f.have == hdrLen {
			f.have = 0
			if f.hdr[1] == typeData {
				f.body = int(binary.BigEndian.Uint32(f.hdr[8:12]))
			}
		}
	}
}

// finish writes zeros to w until the current frame is whole.
func (f *frameTracker) finish(w io.Writer) error {
	var zeros [4096]byte
	for f.have > 0 || f.body > 0 {
		n := hdrLen - f.have
		if f.have == 0 {
			n = min(f.body, len(zeros))
		}
		m, err := w.Write(zeros[:n])
		f.track(zeros[:m])
		if err != nil {
			return err
		}
	}
	return nil
}
