package agent

import (
	"bytes"
	"runtime"
	"testing"
	"time"
)

// heapAfterGC is the live heap after a full collection.
func heapAfterGC() uint64 {
	runtime.GC()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc
}

// patternByte is the byte at offset i of the test output.
func patternByte(i int) byte { return byte(i % 251) }

func TestOutLogMemoryBoundedForTinyWrites(t *testing.T) {
	const max = 1 << 20
	for _, tc := range []struct {
		name  string
		kinds []outKind
	}{
		{"same kind", []outKind{outStdout}},
		{"alternating kinds", []outKind{outStdout, outStderr}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := heapAfterGC()
			l := newOutLog(max)
			const writes = 1 << 20
			for i := range writes {
				l.append(tc.kinds[i%len(tc.kinds)], []byte{patternByte(i)})
			}
			grown := int64(heapAfterGC()) - int64(before)
			t.Logf("heap grew by %d bytes for %d one-byte writes (cap %d)", grown, writes, max)
			if grown > 3*max {
				t.Errorf("retained heap grew by %d bytes; want at most %d (3× the %d-byte cap)", grown, 3*max, max)
			}

			// A reader from the start learns what was dropped, then gets the
			// newest bytes, in order, with the right kinds.
			evs, next, dropped, _, _ := l.read(cursor{}, writes)
			if dropped == 0 {
				t.Fatal("dropped = 0 after writing 1 MiB as tiny chunks into a 1 MiB log")
			}
			off := int(dropped)
			for _, e := range evs {
				if int(e.off) != off {
					t.Fatalf("event at offset %d; want %d", e.off, off)
				}
				if len(e.data) > maxChunk {
					t.Fatalf("event of %d bytes; want at most %d", len(e.data), maxChunk)
				}
				for j, b := range e.data {
					if want := patternByte(off + j); b != want {
						t.Fatalf("byte at offset %d = %d; want %d", off+j, b, want)
					}
					if want := tc.kinds[(off+j)%len(tc.kinds)]; e.kind != want {
						t.Fatalf("byte at offset %d has kind %d; want %d", off+j, e.kind, want)
					}
				}
				off += len(e.data)
			}
			if off != writes || next.off != writes {
				t.Fatalf("read up to offset %d, cursor %d; want %d", off, next.off, writes)
			}
			runtime.KeepAlive(l)
		})
	}
}

// A reader that keeps up gets every byte exactly once, even when it reads
// in the middle of a chunk that later appends grow.
func TestOutLogReaderMidChunk(t *testing.T) {
	l := newOutLog(1 << 20)
	var got bytes.Buffer
	var c cursor
	const writes = 100000
	for i := range writes {
		l.append(outStdout, []byte{patternByte(i)})
		if i%777 == 0 {
			evs, next, dropped, done, _ := l.read(c, 5000)
			if dropped != 0 || done {
				t.Fatalf("dropped = %d, done = %v; want 0, false", dropped, done)
			}
			for _, e := range evs {
				got.Write(e.data)
			}
			c = next
		}
	}
	l.close()
	for {
		evs, next, _, done, _ := l.read(c, 5000)
		for _, e := range evs {
			got.Write(e.data)
		}
		c = next
		if done {
			break
		}
		if len(evs) == 0 {
			t.Fatal("read returned nothing before done")
		}
	}
	if got.Len() != writes {
		t.Fatalf("read %d bytes; want %d", got.Len(), writes)
	}
	for i, b := range got.Bytes() {
		if b != patternByte(i) {
			t.Fatalf("byte %d = %d; want %d", i, b, patternByte(i))
		}
	}
}

// Chunks of different kinds stay apart, and tail skips what came before.
func TestOutLogKindsAndTail(t *testing.T) {
	l := newOutLog(1 << 20)
	l.append(outStdout, []byte("a"))
	l.append(outStdout, []byte("b"))
	l.append(outStderr, []byte("c"))
	tail := l.tail()
	l.append(outStdout, []byte("d"))
	evs, _, _, _, _ := l.read(cursor{}, 1<<20)
	var got []string
	for _, e := range evs {
		got = append(got, string("oep"[e.kind])+":"+string(e.data))
	}
	if want := []string{"o:ab", "e:c", "o:d"}; !equalStrings(got, want) {
		t.Fatalf("events = %q; want %q", got, want)
	}
	evs, _, _, _, _ = l.read(tail, 1<<20)
	if len(evs) != 1 || string(evs[0].data) != "d" {
		t.Fatalf("events after tail = %v; want one \"d\"", evs)
	}
}

func equalStrings(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// An attached reader makes writers wait instead of dropping what it has not
// read; detaching lets them drop again.
func TestOutLogWaitsForAttachedReader(t *testing.T) {
	const max = 256 << 10
	l := newOutLog(max)
	r := l.attach(cursor{})
	const total = 4 * max
	wrote := make(chan struct{})
	go func() {
		defer close(wrote)
		for i := 0; i < total; i += 1024 {
			chunk := make([]byte, 1024)
			for j := range chunk {
				chunk[j] = patternByte(i + j)
			}
			l.append(outStdout, chunk)
		}
		l.close()
	}()
	var got []byte
	c := cursor{}
	for {
		evs, next, dropped, done, wait := l.read(c, 64<<10)
		if dropped > 0 {
			t.Fatalf("an attached reader lost %d bytes at offset %d", dropped, c.off)
		}
		for _, e := range evs {
			got = append(got, e.data...)
		}
		c = next
		l.advance(r, c)
		if done {
			break
		}
		if len(evs) == 0 {
			<-wait
		}
	}
	<-wrote
	if len(got) != total {
		t.Fatalf("read %d bytes; want %d", len(got), total)
	}
	for i, b := range got {
		if b != patternByte(i) {
			t.Fatalf("byte %d = %d; want %d", i, b, patternByte(i))
		}
	}

	// A detached reader no longer holds writers back: they drop.
	l2 := newOutLog(max)
	r2 := l2.attach(cursor{})
	l2.detach(r2)
	for i := 0; i < total; i += 1024 {
		l2.append(outStdout, make([]byte, 1024)) // must not block
	}
	if _, _, dropped, _, _ := l2.read(cursor{}, 1024); dropped == 0 {
		t.Fatal("with no reader attached nothing was dropped")
	}
}

// TestSecurityExecOutputNotHeldAfterExit: once the process exited, writers
// (the pumps draining its pipes) no longer wait for a slow attached reader,
// so its end is recorded at once and nothing is lost; past 2*max (orphans
// still writing) the oldest is dropped and the reader told how much.
func TestSecurityExecOutputNotHeldAfterExit(t *testing.T) {
	const max = 64 << 10
	l := newOutLog(max)
	l.attach(cursor{})
	fill := func(n int) {
		t.Helper()
		done := make(chan struct{})
		go func() {
			defer close(done)
			for i := 0; i < n; i += 1024 {
				l.append(outStdout, bytes.Repeat([]byte{'y'}, 1024))
			}
		}()
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			t.Fatal("append blocked after the process exited")
		}
	}
	l.processExited()
	fill(max + max/2) // what a pipe still held, and more
	evs, _, dropped, _, _ := l.read(cursor{}, 4*max)
	n := 0
	for _, e := range evs {
		n += len(e.data)
	}
	if dropped != 0 || n != max+max/2 {
		t.Fatalf("after the exit: read %d bytes, %d dropped; want all %d, none dropped", n, dropped, max+max/2)
	}
	fill(2 * max)
	if _, _, dropped, _, _ := l.read(cursor{}, 1024); dropped == 0 {
		t.Fatal("past 2*max after the exit nothing was dropped")
	}
}
