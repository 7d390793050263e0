package cli

import (
	"encoding/json"
	"fmt"
	"runtime"

	"github.com/spf13/cobra"

	"github.com/kernflux/opendsec/internal/version"
)

func (a *app) versionCommand() *cobra.Command {
	return &cobra.Command{
		Use:     "version",
		Short:   "Print the client version",
		Example: `  opendsecctl version`,
		Args:    exactArgs(0, "no arguments"),
		RunE: func(cmd *cobra.Command, args []string) error {
			if a.output == "json" {
				enc := json.NewEncoder(a.stdout)
				enc.SetIndent("", "  ")
				return enc.Encode(map[string]string{"client": version.Version, "go": runtime.Version()})
			}
			fmt.Fprintf(a.stdout, "opendsecctl %s (%s)\n", version.Version, runtime.Version())
			return nil
		},
	}
}
