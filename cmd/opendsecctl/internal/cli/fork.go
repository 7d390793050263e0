package cli

import (
	"fmt"
	"time"

	"github.com/spf13/cobra"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	opendsec "github.com/kernflux/opendsec/sdk/go"
)

func (a *app) forkCommand() *cobra.Command {
	var (
		count     int
		timeout   string
		requestID string
	)
	cmd := &cobra.Command{
		Use:   "fork ID [--count N]",
		Short: "Make N new running sandboxes from a sandbox's state now",
		Long: `Fork makes --count (1..64) new running sandboxes on the sandbox's node, each
with its files at this instant, its image, limits, env, network policy, labels
and task, and its own ID and hostname. The sandbox (running or paused) is
frozen only while its writable layer is copied. Containers fork their files,
not their memory: the forks' processes start again (memory_preserved false).
All forks are made, or none. Prints the new IDs, one a line.`,
		Example: `  opendsecctl sandbox fork n001sb0001 --count 8
  opendsecctl sandbox fork n001sb0001 -o json`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if count < 1 || count > opendsec.MaxForkCount {
				return usagef("--count: is %d; give 1..%d forks", count, opendsec.MaxForkCount)
			}
			secs, err := parseSeconds("timeout", timeout)
			if err != nil {
				return err
			}
			c, err := a.connect()
			if err != nil {
				return err
			}
			out, err := c.ForkSandbox(cmd.Context(), args[0], count, opendsec.ForkOptions{RequestID: requestID, Timeout: time.Duration(secs) * time.Second})
			if err != nil {
				return err
			}
			if a.output == "json" {
				resp := &opendsecv1.ForkSandboxResponse{SourceFrozenUs: out.SourceFrozen.Microseconds()}
				for _, f := range out.Forks {
					resp.Forks = append(resp.Forks, &opendsecv1.ForkResult{Sandbox: f.Sandbox, MemoryPreserved: f.MemoryPreserved})
				}
				return printJSON(a.stdout, resp)
			}
			for _, f := range out.Forks {
				fmt.Fprintln(a.stdout, f.Sandbox.GetId())
			}
			fmt.Fprintf(a.stderr, "%d forks of %s (source frozen %s, memory preserved: %s)\n",
				len(out.Forks), args[0], out.SourceFrozen.Round(time.Microsecond), yesNo(len(out.Forks) > 0 && out.Forks[0].MemoryPreserved))
			return nil
		},
	}
	cmd.Flags().IntVarP(&count, "count", "n", 1, "how many forks (1..64)")
	cmd.Flags().StringVar(&timeout, "timeout", "", "the forks' lifetime, e.g. 10m (default: the source's)")
	cmd.Flags().StringVar(&requestID, "request-id", "", "idempotency key: a retry with the same one returns the same forks (default: a new one)")
	return cmd
}
