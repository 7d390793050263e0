// Command opendsec-e2b runs OpenDsec's E2B-compatible gateway on its own (the
// same code `opendsec up` composes in one process). `opendsec-e2b key create`
// prints a new E2B API key.
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
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if err := daemon.NewE2BCommand().ExecuteContext(ctx); err != nil {
		fmt.Fprintln(os.Stderr, "error:", err)
		os.Exit(1)
	}
}
