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
	"github.com/kernflux/opendsec/internal/gosysmon"
)

func main() {
	// Go's defaults for the GC (GOGC 100: at 200% the node's RSS grew by
	// 85-98 MiB streaming output, TestYesDoesNotGrowTheNode) and for
	// GOMAXPROCS (4 on 2 CPUs, to keep Ps free for goroutines leaving
	// syscalls, cost the node more CPU per create in a burst, not less).
	gosysmon.Slow() // sysmon wakes less: internal/gosysmon
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if err := daemon.NewRootCommand().ExecuteContext(ctx); err != nil {
		fmt.Fprintln(os.Stderr, "error:", err)
		os.Exit(1)
	}
}
