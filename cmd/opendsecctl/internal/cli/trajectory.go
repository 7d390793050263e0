package cli

import (
	"github.com/spf13/cobra"
	"google.golang.org/protobuf/encoding/protojson"
)

func (a *app) logCommand() *cobra.Command {
	var noOutput bool
	cmd := &cobra.Command{
		Use:   "log ID",
		Short: "Print a sandbox's trajectory log: every exec and file write, in order, one JSON line each",
		Long: `Print a sandbox's trajectory log (docs/concepts.md "Trajectory log"): one JSON
line per call, oldest first, with its seq, call_id, request, times, exit code
and recorded output (base64 stdout/stderr); a file write has its path,
sha256, size and http_status. The first line also names the sandbox and,
for a fork or a sandbox started from a snapshot, its parent. A stopped sandbox's log is kept for its
node's node.trajectory.retention_sec.`,
		Example: `  opendsecctl sandbox log n001sb0001
  opendsecctl sandbox log n001sb0001 --no-output | jq -r '[.seq, .call_id, (.command|join(" ")), .exit_code] | @tsv'`,
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) != 1 {
				return usagef("sandbox log: give one sandbox ID")
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.connect()
			if err != nil {
				return err
			}
			entries, err := c.Trajectory(cmd.Context(), args[0], !noOutput)
			if err != nil {
				return err
			}
			m := protojson.MarshalOptions{UseProtoNames: true}
			for _, e := range entries {
				b, err := m.Marshal(e)
				if err != nil {
					return err
				}
				_, _ = a.stdout.Write(append(b, '\n'))
			}
			return nil
		},
	}
	cmd.Flags().BoolVar(&noOutput, "no-output", false, "leave out each call's recorded stdout and stderr")
	return cmd
}
