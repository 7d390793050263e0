// Package testutil holds helpers shared by tests: privileged-test gates that
// fail loudly and shared fixtures.
package testutil

import (
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"sync"
	"testing"
)

// RequiresRoot skips t unless the process is root. When OPENDSEC_ROOT_TESTS=1
// (set by `make test` and CI) a non-root run fails instead of skipping, so a
// privileged suite can never silently pass.
func RequiresRoot(t testing.TB) {
	t.Helper()
	if os.Geteuid() == 0 {
		return
	}
	if os.Getenv("OPENDSEC_ROOT_TESTS") == "1" {
		t.Fatal("OPENDSEC_ROOT_TESTS=1 but not running as root: run the privileged tests as root")
	}
	t.Skip("needs root (run as root, or set OPENDSEC_ROOT_TESTS=1 to make this an error)")
}

// RequiresKVM skips t with the reason when /dev/kvm is missing.
func RequiresKVM(t testing.TB) {
	t.Helper()
	if _, err := os.Stat("/dev/kvm"); err != nil {
		t.Skip("needs /dev/kvm (not present on this machine): " + err.Error())
	}
}

var (
	portsMu sync.Mutex
	ports   = map[int]bool{} // handed out in this process
)

// FreePort returns a loopback port nothing listens on, below the kernel's
// ephemeral range (so no outgoing connection takes it between the pick and
// the caller's listen), never the same one twice in this process. Asking
// the kernel for port 0 could hand out one port twice in a row, and a
// system then failed to start ("address already in use").
func FreePort(t testing.TB) int {
	t.Helper()
	portsMu.Lock()
	defer portsMu.Unlock()
	for range 1000 {
		p := 20000 + rand.IntN(12000) // 20000-31999; ephemeral ports start at 32768
		if ports[p] {
			continue
		}
		l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", p))
		if err != nil {
			continue
		}
		l.Close()
		ports[p] = true
		return p
	}
	t.Fatal("no free loopback port in 20000-31999 after 1000 tries")
	return 0
}
