// Command opendsec-guestinit is PID 1 of a VM sandbox's guest (the initramfs's
// /init). It mounts the kernel filesystems, loads the virtio modules in the
// order the asset build resolved, sets the hostname from the kernel command
// line, starts the agent and bridges the virtio-serial port "agent" (yamux,
// internal/vmchan) to it. The contract is docs/vm-guest.md.
package main

import (
	"os"
	"strings"
)

// bootArgs is the opendsec.* keys of the kernel command line.
type bootArgs map[string]string

// parseCmdline returns the opendsec.* keys of a kernel command line, without the prefix.
func parseCmdline(s string) bootArgs {
	a := bootArgs{}
	for _, f := range strings.Fields(s) {
		k, v, ok := strings.Cut(f, "=")
		if ok && strings.HasPrefix(k, "opendsec.") {
			a[strings.TrimPrefix(k, "opendsec.")] = v
		}
	}
	return a
}

func logf(s string) { _, _ = os.Stderr.WriteString("opendsec: " + s + "\n") }

func main() { os.Exit(run()) }
