package agent

import (
	"bytes"
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/kernflux/opendsec/api/gen/process"
	"github.com/kernflux/opendsec/api/gen/process/processconnect"
)

// TestSecurityExecOutputSlowReaderHoldsProcessBack: a Start stream read
// slowly by a client like the apiserver's (protobuf, gzip accepted) holds
// the process to the reader's pace, so when the process ends only a bounded
// amount of output is still on its way and the reader gets the exit soon
// after (issue 11, finding 1). Compressed, the transport's buffers held
// hundreds of times their size: the process ran ahead of its reader, and
// `timeout 5 yes` read at 5 ms per event ended 90 s after `yes` did.
func TestSecurityExecOutputSlowReaderHoldsProcessBack(t *testing.T) {
	e := newEnv(t, Config{})
	ctx, cancel := context.WithTimeout(t.Context(), 120*time.Second)
	defer cancel()
	// As the apiserver's client: binary protobuf, gzip accepted (connect's default).
	pc := processconnect.NewProcessClient(e.http, base)
	const n = 128 << 20
	s, err := pc.Start(ctx, startReq("/bin/sh", "-c", "head -c "+strconv.Itoa(n)+" /dev/zero"))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	var (
		p        *proc
		got      int64
		lagAtEnd = int64(-1) // bytes not yet read when the agent recorded the end
		end      *process.ProcessEvent_EndEvent
	)
	for i := 0; s.Receive(); i++ {
		ev := s.Msg().GetEvent()
		if st := ev.GetStart(); st != nil {
			if p, err = e.agent.procs.find(pid(st.GetPid()), true); err != nil {
				t.Fatal(err)
			}
		}
		if d := ev.GetData().GetStdout(); d != nil {
			if bytes.Count(d, []byte{0}) != len(d) {
				t.Fatalf("unexpected output %q", d[:min(len(d), 200)])
			}
			got += int64(len(d))
		}
		if ev.GetData().GetStderr() != nil {
			t.Fatalf("stderr %q", ev.GetData().GetStderr())
		}
		if ev.GetEnd() != nil {
			end = ev.GetEnd()
		}
		if lagAtEnd < 0 && p != nil && p.ended() != nil {
			lagAtEnd = n - got
			t.Logf("the process ended with %d KiB not yet read", lagAtEnd>>10)
		}
		time.Sleep(time.Millisecond) // a slow reader (pacing, not synchronisation)
	}
	if err := s.Err(); err != nil {
		t.Fatalf("stream: %v", err)
	}
	if got != n || end == nil || end.GetExitCode() != 0 {
		t.Fatalf("got %d of %d bytes, end %v", got, n, end)
	}
	// The agent's log plus the pipe's and the socket's buffers (~1.1 MiB
	// here; compressed, 8.7 MiB through this socket and ~250 MiB through
	// the node and the apiserver).
	if lagAtEnd > DefaultMaxOutputBytes+2<<20 {
		t.Fatalf("the process ended %d MiB ahead of its reader; a Start stream's reader must hold it back", lagAtEnd>>20)
	}
}
