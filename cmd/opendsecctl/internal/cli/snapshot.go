package cli

import (
	"fmt"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/kernflux/opendsec/internal/progressbar"
	opendsec "github.com/kernflux/opendsec/sdk/go"
)

// sandboxSnapshotCommand is `opendsecctl sandbox snapshot ID [--name N]`.
func (a *app) sandboxSnapshotCommand() *cobra.Command {
	var name string
	c := &cobra.Command{
		Use:   "snapshot ID [--name NAME]",
		Short: "Save a sandbox as a named snapshot (it keeps running); start sandboxes from it with create --snapshot",
		Example: `  opendsecctl sandbox snapshot n0017d3kq2x9c4m1p0z8 --name after-setup
  opendsecctl sandbox create --snapshot <snapshot-id> --count 8`,
		Args: exactArgs(1, "ID"),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.connect()
			if err != nil {
				return err
			}
			snap, err := c.CreateSnapshot(cmd.Context(), args[0], name)
			if err != nil {
				return err
			}
			return a.printSnapshots([]*opendsec.Snapshot{snap})
		},
	}
	c.Flags().StringVar(&name, "name", "", "name of the snapshot: 1-128 characters of [A-Za-z0-9._-] (default: the sandbox ID and the time)")
	return c
}

// snapshotCommand is `opendsecctl snapshot list|get|rm`.
func (a *app) snapshotCommand() *cobra.Command {
	c := &cobra.Command{Use: "snapshot", Aliases: []string{"snapshots"}, Short: "List, inspect and remove snapshots (make them with `sandbox snapshot`)"}
	list := &cobra.Command{
		Use:     "list",
		Aliases: []string{"ls"},
		Short:   "List your snapshots",
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.connect()
			if err != nil {
				return err
			}
			snaps, err := c.ListSnapshots(cmd.Context())
			if err != nil {
				return err
			}
			return a.printSnapshots(snaps)
		},
	}
	get := &cobra.Command{
		Use:   "get ID",
		Short: "Show a snapshot (JSON with -o json)",
		Args:  exactArgs(1, "ID"),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.connect()
			if err != nil {
				return err
			}
			snap, err := c.GetSnapshot(cmd.Context(), args[0])
			if err != nil {
				return err
			}
			return a.printSnapshots([]*opendsec.Snapshot{snap})
		},
	}
	rm := &cobra.Command{
		Use:     "rm ID...",
		Aliases: []string{"delete"},
		Short:   "Remove snapshots (sandboxes started from them keep running)",
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) == 0 {
				return usagef("snapshot rm: give at least one snapshot ID")
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.connect()
			if err != nil {
				return err
			}
			for _, id := range args {
				if err := c.DeleteSnapshot(cmd.Context(), id); err != nil {
					return err
				}
				fmt.Fprintln(a.stdout, id)
			}
			return nil
		},
	}
	c.AddCommand(list, get, rm)
	return c
}

func (a *app) printSnapshots(snaps []*opendsec.Snapshot) error {
	if a.output == "json" {
		for _, s := range snaps {
			if err := printJSON(a.stdout, s); err != nil {
				return err
			}
		}
		return nil
	}
	tw := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tNAME\tSOURCE\tIMAGE\tMEMORY\tSIZE\tCREATED")
	for _, s := range snaps {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%v\t%s\t%s\n", s.GetId(), s.GetName(), s.GetSourceSandboxId(), s.GetSpec().GetImage(),
			s.GetMemory(), progressbar.Bytes(s.GetSizeBytes()), fmtTime(s.GetCreatedAt()))
	}
	return tw.Flush()
}
