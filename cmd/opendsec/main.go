// Command opendsec runs OpenDsec: `opendsec up` starts the whole system for
// one machine in one process; other subcommands administer it.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/kernflux/opendsec/internal/daemon"
)

func main() {
	// The daemons allocate a little per request on a small heap: a
	// collection at 200% growth instead of Go's 100% halves the GC's share
	// of a burst's CPU for a few MiB more heap. A GOGC other than the
	// default 100 is left as it is.
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if err := daemon.NewRootCommand().ExecuteContext(ctx); err != nil {
		fmt.Fprintln(os.Stderr, "error:", err)
		os.Exit(1)
	}
}
