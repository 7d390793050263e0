package cli

import (
	"fmt"
	"sort"
	"text/tabwriter"

	"github.com/spf13/cobra"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	opendsec "github.com/kernflux/opendsec/sdk/go"
)

func (a *app) taskCommand() *cobra.Command {
	task := &cobra.Command{Use: "task", Short: "Pause, resume and list the sandboxes of a task (a training job) together"}
	task.AddCommand(a.taskPauseCommand(), a.taskResumeCommand(), a.taskListCommand())
	return task
}

func (a *app) taskPauseCommand() *cobra.Command {
	var (
		reclaim bool
		labels  []string
	)
	cmd := &cobra.Command{
		Use:   "pause TASK [--reclaim] [--label KEY=VALUE]",
		Short: "Freeze every sandbox of a task on every node at once, and free their memory with --reclaim",
		Long: `Pause freezes every sandbox of the task (its task_id) on every node at once.
With --reclaim each node then pushes the paused sandboxes' memory out of RAM:
to swap where the node has it (the quickstart sets up zram swap), page cache
either way. It prints the bytes each sandbox freed and the total. A resumed
sandbox takes its pages back as it touches them; its processes and data are
kept. "task resume" brings them back; any call to one of them resumes just
that one.`,
		Example: `  opendsecctl task pause job-42 --reclaim
  opendsecctl task pause job-42 --label shard=3`,
		Args: exactArgs(1, "TASK"),
		RunE: func(cmd *cobra.Command, args []string) error {
			l, err := parseKV("label", labels)
			if err != nil {
				return err
			}
			c, err := a.connect()
			if err != nil {
				return err
			}
			out, err := c.PauseTask(cmd.Context(), args[0], opendsec.PauseTaskOptions{Reclaim: reclaim, Labels: l})
			if err != nil {
				return err
			}
			return a.printTaskPause(out, reclaim)
		},
	}
	cmd.Flags().BoolVar(&reclaim, "reclaim", false, "push the paused sandboxes' memory out of RAM and report the bytes freed")
	cmd.Flags().StringArrayVar(&labels, "label", nil, "only the task's sandboxes with label KEY=VALUE (repeatable, AND-ed)")
	return cmd
}

func (a *app) printTaskPause(out *opendsec.BatchOutcome, reclaim bool) error {
	if a.output == "json" {
		if err := printJSON(a.stdout, &opendsecv1.PauseSandboxesResponse{Sandboxes: out.Sandboxes, Reclaimed: out.Reclaimed, BytesFreed: out.BytesFreed}); err != nil {
			return err
		}
	} else if reclaim {
		tw := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "SANDBOX\tBEFORE\tAFTER\tFREED\tNOTE")
		for _, r := range out.Reclaimed {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", r.GetSandboxId(), mib(r.GetBytesBefore()), mib(r.GetBytesAfter()), mib(r.GetBytesFreed()), orDash(r.GetNote()))
		}
		if err := tw.Flush(); err != nil {
			return err
		}
	} else {
		for _, sb := range out.Sandboxes {
			fmt.Fprintln(a.stdout, sb.GetId())
		}
	}
	for _, f := range out.Failures {
		fmt.Fprintf(a.stderr, "error: %s: %s\n", orDash(f.ID), messageOf(f.Err))
	}
	if reclaim {
		fmt.Fprintf(a.stderr, "%d sandboxes paused, %d failed, %s freed\n", len(out.Sandboxes), len(out.Failures), mib(out.BytesFreed))
	} else {
		fmt.Fprintf(a.stderr, "%d sandboxes paused, %d failed\n", len(out.Sandboxes), len(out.Failures))
	}
	if len(out.Failures) > 0 {
		return &exitError{code: 1}
	}
	return nil
}

func (a *app) taskResumeCommand() *cobra.Command {
	var labels []string
	cmd := &cobra.Command{
		Use:   "resume TASK [--label KEY=VALUE]",
		Short: "Thaw every paused sandbox of a task",
		Long: `Resume thaws every paused sandbox of the task on every node at once; each
continues with the lifetime it had left at the pause.`,
		Example: `  opendsecctl task resume job-42`,
		Args:    exactArgs(1, "TASK"),
		RunE: func(cmd *cobra.Command, args []string) error {
			l, err := parseKV("label", labels)
			if err != nil {
				return err
			}
			c, err := a.connect()
			if err != nil {
				return err
			}
			out, err := c.ResumeTask(cmd.Context(), args[0], l)
			if err != nil {
				return err
			}
			return a.printBatch("resumed", out)
		},
	}
	cmd.Flags().StringArrayVar(&labels, "label", nil, "only the task's sandboxes with label KEY=VALUE (repeatable, AND-ed)")
	return cmd
}

// taskRow is one task of "task list".
type taskRow struct {
	id      string
	total   int
	byState map[opendsecv1.SandboxState]int
}

func (a *app) taskListCommand() *cobra.Command {
	return &cobra.Command{
		Use:     "list",
		Short:   "List tasks with their sandbox counts by state",
		Example: `  opendsecctl task list`,
		Args:    exactArgs(0, "no arguments"),
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := a.connect()
			if err != nil {
				return err
			}
			sbs, err := c.ListSandboxes(cmd.Context(), opendsec.ListFilter{})
			if err != nil {
				return err
			}
			rows := map[string]*taskRow{}
			for _, sb := range sbs {
				id := sb.GetSpec().GetTaskId()
				if id == "" {
					continue
				}
				r, ok := rows[id]
				if !ok {
					r = &taskRow{id: id, byState: map[opendsecv1.SandboxState]int{}}
					rows[id] = r
				}
				r.total++
				r.byState[sb.GetState()]++
			}
			ids := make([]string, 0, len(rows))
			for id := range rows {
				ids = append(ids, id)
			}
			sort.Strings(ids)
			if a.output == "json" {
				out := &opendsecv1.ListSandboxesResponse{}
				for _, sb := range sbs {
					if sb.GetSpec().GetTaskId() != "" {
						out.Sandboxes = append(out.Sandboxes, sb)
					}
				}
				return printJSON(a.stdout, out)
			}
			tw := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "TASK\tSANDBOXES\tRUNNING\tPAUSED\tOTHER")
			for _, id := range ids {
				r := rows[id]
				run, paused := r.byState[opendsecv1.SandboxState_SANDBOX_STATE_RUNNING], r.byState[opendsecv1.SandboxState_SANDBOX_STATE_PAUSED]
				fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%d\n", id, r.total, run, paused, r.total-run-paused)
			}
			return tw.Flush()
		},
	}
}
