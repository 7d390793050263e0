//go:build linux

package security

import (
	"errors"
	"io"
	"testing"
	"time"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
)

// Finding 1, the slow reader: `timeout 5 yes` read at 5 ms per event
// through the API ends soon after the command does, with everything the
// process wrote delivered: the reader holds the process back, and little is
// on its way when it ends. With compressed process output the transports
// held hundreds of MiB ahead of the exit: 200-300 MiB in 75-100 s.
// Package tests: internal/agent TestSecurityExecOutputSlowReaderHoldsProcessBack
// and TestSecurityExecOutputNotHeldAfterExit, internal/apiserver
// TestSecurityExecOutputIsNotCompressed.
func checkExecOutputSlowReader(t *testing.T, e *env) {
	id := e.create(t, nil)
	start := time.Now()
	st := e.Processes().Exec(t.Context())
	if err := st.Send(&opendsecv1.ExecRequest{Msg: &opendsecv1.ExecRequest_Start{Start: &opendsecv1.ExecStart{
		SandboxId: id, Command: []string{"timeout", "5", "yes"}, TimeoutSeconds: 120}}}); err != nil {
		t.Fatal(err)
	}
	defer st.CloseResponse()
	var (
		got  int64
		exit *opendsecv1.ExecExit
	)
	for exit == nil {
		m, err := st.Receive()
		if errors.Is(err, io.EOF) {
			t.Fatal("exec stream ended without an exit event")
		}
		if err != nil {
			t.Fatal(err)
		}
		got += int64(len(m.GetStdout()))
		exit = m.GetExit()
		time.Sleep(5 * time.Millisecond) // a slow consumer, not synchronisation
	}
	st.CloseRequest()
	took := time.Since(start)
	t.Logf("took %s for %d MiB", took.Round(time.Millisecond), got>>20)
	if got == 0 || exit.GetStdoutTotalBytes() != got || exit.GetOutputTruncated() || exit.GetStatus() != "signal: terminated" {
		t.Fatalf("read %d bytes, exit %v", got, exit)
	}
	// Held to the reader's pace, `yes` writes what the reader takes in 5 s
	// plus what the transports hold: ~25 MiB here, less on a loaded machine.
	// The time follows from it; its bound leaves room for a loaded machine
	// (~7 s here).
	if got > 100<<20 {
		t.Fatalf("slow reader: %d MiB delivered; the process was not held to the reader's pace", got>>20)
	}
	if took > 60*time.Second {
		t.Fatalf("slow reader: the exit came %s after the start (the command ran 5 s)", took.Round(time.Second))
	}
}
