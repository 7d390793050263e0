// Command opendsecctl is the OpenDsec command-line client: create, list,
// inspect and stop sandboxes, run commands in them and copy files in and out.
// See docs/cli.md.
package main

import (
	"os"

	"github.com/kernflux/opendsec/cmd/opendsecctl/internal/cli"
)

func main() {
	os.Exit(cli.Main(os.Args[1:], os.Stdin, os.Stdout, os.Stderr))
}
