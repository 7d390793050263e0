//go:build linux

package e2e

import (
	"strings"
	"sync"
	"testing"
	"time"

	opendsec "github.com/kernflux/opendsec/sdk/go"
)

// checkPTY runs an interactive shell on a terminal in sandbox id through
// the public API (the Go SDK's Exec with a PTY, as a user's terminal
// session): it sees an 80x24 terminal, reads a typed line, follows a
// resize to 132x43, and its exit status comes back.
func (s *system) checkPTY(t *testing.T, id string) {
	t.Helper()
	var (
		mu   sync.Mutex
		out  strings.Builder
		more = make(chan struct{}, 1)
	)
	c := s.Client(t)
	p, err := c.Exec(t.Context(), id, opendsec.ExecOptions{
		Command: []string{"/bin/sh"}, Env: map[string]string{"TERM": "xterm", "PS1": "$ "},
		PTY: &opendsec.PtySize{Cols: 80, Rows: 24},
		OnStdout: func(b []byte) {
			mu.Lock()
			out.Write(b)
			mu.Unlock()
			select {
			case more <- struct{}{}:
			default:
			}
		},
	})
	if err != nil {
		t.Fatalf("exec a shell on a terminal in %s: %v", id, err)
	}
	at := 0
	// step types in and waits for want (printed by the shell's arithmetic,
	// so the terminal's echo of the line cannot match it).
	step := func(in, want string) string {
		t.Helper()
		if err := p.SendStdin([]byte(in)); err != nil {
			t.Fatalf("terminal input to %s: %v", id, err)
		}
		deadline := time.After(60 * time.Second)
		for {
			mu.Lock()
			s := out.String()
			mu.Unlock()
			if i := strings.Index(s[at:], want); i >= 0 {
				seen := s[at : at+i+len(want)]
				at += i + len(want)
				return seen
			}
			select {
			case <-more:
			case <-p.Done():
				t.Fatalf("the shell in %s ended before printing %q; terminal %q", id, want, s)
			case <-deadline:
				t.Fatalf("no %q on the terminal of %s after 60 s: %q", want, id, s)
			}
		}
	}
	if got := step("stty size; tty; echo m-$((6*7))\n", "m-42"); !strings.Contains(got, "24 80") || !strings.Contains(got, "/dev/pts/") {
		t.Errorf("terminal of %s: %q; want stty size 24 80 and a /dev/pts/ tty", id, got)
	}
	step("read line; echo \"got:$line:$((1+1))\"\n", "")
	step("typed words\n", "got:typed words:2")
	if err := p.Resize(132, 43); err != nil {
		t.Fatalf("resize the terminal of %s: %v", id, err)
	}
	if got := step("stty size; echo r-$((2*3))\n", "r-6"); !strings.Contains(got, "43 132") {
		t.Errorf("terminal of %s after a resize to 132x43: %q", id, got)
	}
	if err := p.SendStdin([]byte("exit 7\n")); err != nil {
		t.Fatal(err)
	}
	st, err := p.Wait()
	if err != nil {
		t.Fatalf("wait for the shell in %s: %v", id, err)
	}
	if st.ExitCode != 7 || st.Status != "exit status 7" {
		t.Fatalf("the shell in %s ended %+v, want exit status 7", id, st)
	}
}
