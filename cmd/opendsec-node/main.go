// Command opendsec-node runs OpenDsec's node component on its own (the same
// code `opendsec up` composes in one process).
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
	gosysmon.Slow() // sysmon wakes less: internal/gosysmon
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if err := daemon.NewComponentCommand("node").ExecuteContext(ctx); err != nil {
		fmt.Fprintln(os.Stderr, "error:", err)
		os.Exit(1)
	}
}
