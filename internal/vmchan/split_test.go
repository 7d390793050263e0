package vmchan

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"path/filepath"
	"testing"
	"time"
)

// socketPair is two ends of a unix socket (buffered, unlike net.Pipe).
func socketPair(t *testing.T) (a, b net.Conn) {
	t.Helper()
	ln, err := net.Listen("unix", filepath.Join(t.TempDir(), "s"))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = ln.Close() }()
	a, err = net.Dial("unix", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	b, err = ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = a.Close(); _ = b.Close() })
	return a, b
}

func frameBody(typ byte, flags uint16, stream, length uint32, body []byte) []byte {
	return append(frame(typ, flags, stream, length), body...)
}

// TestHelloSkipsOldSessionsOutput: the guest's old session wrote half a
// data frame (and more frames) that reach the new host; the host's hello
// skips them, the old session's half frame is padded so the skip stays
// on frame boundaries, the old session cannot write any more, and what
// the new session writes after its answer reaches the new host intact.
func TestHelloSkipsOldSessionsOutput(t *testing.T) {
	guest, host := socketPair(t)
	p := &portSplitter{rw: guest}
	old := p.next()

	// The old host's first frame, then the old session's output.
	if _, err := host.Write(frame(typeWindowUpd, flagSYN, 1, 0)); err != nil {
		t.Fatal(err)
	}
	h := make([]byte, hdrLen)
	if _, err := io.ReadFull(old, h); err != nil {
		t.Fatal(err)
	}
	if _, err := old.Write(frame(typeWindowUpd, flagACK, 1, 0)); err != nil {
		t.Fatal(err)
	}
	half := frameBody(typeData, 0, 1, 100, bytes.Repeat([]byte{'x'}, 10))
	if _, err := old.Write(half); err != nil {
		t.Fatal(err)
	}

	// The new host says hello; the guest's old session ends at it.
	ctx := context.Background()
	hc, err := hello(ctx, host)
	if err != nil {
		t.Fatal(err)
	}
	// A host that misses the answer waits for it: fail instead.
	_ = host.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.ReadFull(old, h); !errors.Is(err, io.EOF) {
		t.Fatalf("the old session read %v at the new host's hello; want EOF", err)
	}
	if _, err := old.Write([]byte("late")); !errors.Is(err, errSessionSplit) {
		t.Fatalf("the old session wrote after the split: %v; want errSessionSplit", err)
	}
	// The new session: the splitter answers the hello as the session reads,
	// and yamux (here the test) never sees it: its first frame is the new
	// host's SYN.
	syn := frame(typeWindowUpd, flagSYN, 1, 0)
	if _, err := hc.Write(syn); err != nil {
		t.Fatal(err)
	}
	cur := p.next()
	if _, err := io.ReadFull(cur, h); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(h, syn) {
		t.Fatalf("the new session's first frame is %x; want the host's SYN %x (the hello is the splitter's)", h, syn)
	}
	if _, err := cur.Write(frameBody(typeData, 0, 1, 2, []byte("ok"))); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, hdrLen+2)
	if _, err := io.ReadFull(hc, got); err != nil {
		t.Fatal(err)
	}
	if want := frameBody(typeData, 0, 1, 2, []byte("ok")); !bytes.Equal(got, want) {
		t.Fatalf("after the hello the host read %x; want %x", got, want)
	}
}

// TestFrameTrackerFinish: a half-written header and a half-written body
// are both completed with zeros.
func TestFrameTrackerFinish(t *testing.T) {
	for _, written := range [][]byte{
		frameBody(typeData, 0, 3, 7, []byte("abc")),
		frame(typeData, 0, 3, 7)[:5],
		frame(typeWindowUpd, flagACK, 3, 9),
	} {
		var f frameTracker
		f.track(written)
		var out bytes.Buffer
		if err := f.finish(&out); err != nil {
			t.Fatal(err)
		}
		var check frameTracker
		check.track(append(append([]byte{}, written...), out.Bytes()...))
		if check.have != 0 || check.body != 0 {
			t.Fatalf("after %x and the padding %x the frame is not whole", written, out.Bytes())
		}
		if f.have != 0 || f.body != 0 {
			t.Fatalf("the tracker of %x is not at a frame boundary after finish", written)
		}
	}
}
