package cli

import (
	"fmt"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	opendsec "github.com/kernflux/opendsec/sdk/go"
)

// selectorFlags are the batch flags of pause and resume.
type selectorFlags struct {
	task   string
	labels []string
}

func (s *selectorFlags) register(cmd *cobra.Command) {
	cmd.Flags().StringVar(&s.task, "task", "", "every sandbox of this task ID (on every node at once)")
	cmd.Flags().StringArrayVar(&s.labels, "label", nil, "every sandbox with label KEY=VALUE (repeatable, AND-ed)")
}

// selector builds the batch selector; batch is false when only IDs were
// given (one call per ID).
func (s *selectorFlags) selector(verb string, ids []string) (opendsec.Selector, bool, error) {
	labels, err := parseKV("label", s.labels)
	if err != nil {
		return opendsec.Selector{}, false, err
	}
	if s.task == "" && len(labels) == 0 {
		if len(ids) == 0 {
			return opendsec.Selector{}, false, usagef("sandbox %s: give sandbox IDs, --task or --label", verb)
		}
		return opendsec.Selector{}, false, nil
	}
	return opendsec.Selector{TaskID: s.task, Labels: labels, IDs: ids}, true, nil
}

func (a *app) pauseCommand() *cobra.Command {
	var (
		sel            selectorFlags
		filesystemOnly bool
	)
	cmd := &cobra.Command{
		Use:   "pause [ID...] [--task TASK] [--label KEY=VALUE] [--filesystem-only]",
		Short: "Freeze sandboxes: memory and files kept, lifetime clock stopped",
		Long: `Pause freezes every process of the sandboxes. A paused sandbox keeps its
memory and files, is never stopped by its timeouts, and refuses exec and file
calls until it is resumed. With --task or --label every matching sandbox on
every node is paused at once (a preempted training job). With
--filesystem-only (IDs only; container backend) only the files are kept: the
processes end and the node's memory is freed, and a resume starts the sandbox
again on its files.`,
		Example: `  opendsecctl sandbox pause n001sb0001
  opendsecctl sandbox pause --filesystem-only n001sb0001
  opendsecctl sandbox pause --task job-42`,
		RunE: func(cmd *cobra.Command, args []string) error {
			s, batch, err := sel.selector("pause", args)
			if err != nil {
				return err
			}
			c, err := a.connect()
			if err != nil {
				return err
			}
			if batch {
				if filesystemOnly {
					return usagef("--filesystem-only: give sandbox IDs, not --task or --label (a batch pause keeps memory)")
				}
				out, err := c.PauseSandboxes(cmd.Context(), s)
				if err != nil {
					return err
				}
				return a.printBatch("paused", out)
			}
			if filesystemOnly {
				return a.eachID(args, "pause", func(id string) (*opendsec.Sandbox, error) { return c.PauseSandboxFilesystem(cmd.Context(), id) })
			}
			return a.eachID(args, "pause", func(id string) (*opendsec.Sandbox, error) { return c.PauseSandbox(cmd.Context(), id) })
		},
	}
	sel.register(cmd)
	cmd.Flags().BoolVar(&filesystemOnly, "filesystem-only", false, "keep only the files: end the processes, free the memory; a resume starts the sandbox again on its files (container backend)")
	return cmd
}

func (a *app) resumeCommand() *cobra.Command {
	var (
		sel     selectorFlags
		timeout string
	)
	cmd := &cobra.Command{
		Use:   "resume [ID...] [--task TASK] [--label KEY=VALUE]",
		Short: "Thaw paused sandboxes",
		Long: `Resume thaws paused sandboxes. Their lifetime continues with what was left
when they were paused, or ends --timeout from now.`,
		Example: `  opendsecctl sandbox resume n001sb0001 --timeout 1h
  opendsecctl sandbox resume --task job-42`,
		RunE: func(cmd *cobra.Command, args []string) error {
			secs, err := parseSeconds("timeout", timeout)
			if err != nil {
				return err
			}
			d := time.Duration(secs) * time.Second
			s, batch, err := sel.selector("resume", args)
			if err != nil {
				return err
			}
			c, err := a.connect()
			if err != nil {
				return err
			}
			if batch {
				out, err := c.ResumeSandboxes(cmd.Context(), s, d)
				if err != nil {
					return err
				}
				return a.printBatch("resumed", out)
			}
			return a.eachID(args, "resume", func(id string) (*opendsec.Sandbox, error) { return c.ResumeSandbox(cmd.Context(), id, d) })
		},
	}
	sel.register(cmd)
	cmd.Flags().StringVar(&timeout, "timeout", "", "lifetime from now, e.g. 10m (default: what was left at the pause; the full create timeout after an auto-pause at expiry)")
	return cmd
}

// eachID runs op on every ID, prints the IDs that succeeded and reports
// each failure; like stop, one failure does not stop the others.
func (a *app) eachID(ids []string, verb string, op func(string) (*opendsec.Sandbox, error)) error {
	var sbs []*opendsec.Sandbox
	var failed []error
	for _, id := range ids {
		sb, err := op(id)
		if err != nil {
			failed = append(failed, err)
			if len(ids) > 1 {
				fmt.Fprintf(a.stderr, "error: %s %s: %s\n", verb, id, messageOf(err))
			}
			continue
		}
		sbs = append(sbs, sb)
	}
	if a.output == "json" {
		if err := printJSON(a.stdout, &opendsecv1.ListSandboxesResponse{Sandboxes: sbs}); err != nil {
			return err
		}
	} else {
		for _, sb := range sbs {
			fmt.Fprintln(a.stdout, sb.GetId())
		}
	}
	switch {
	case len(failed) == 0:
		return nil
	case len(ids) == 1:
		return failed[0]
	}
	return &exitError{code: 1}
}

func (a *app) printBatch(verb string, out *opendsec.BatchOutcome) error {
	if a.output == "json" {
		if err := printJSON(a.stdout, &opendsecv1.ListSandboxesResponse{Sandboxes: out.Sandboxes}); err != nil {
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
	fmt.Fprintf(a.stderr, "%d sandboxes %s, %d failed\n", len(out.Sandboxes), verb, len(out.Failures))
	if len(out.Failures) > 0 {
		return &exitError{code: 1}
	}
	return nil
}

func (a *app) metricsCommand() *cobra.Command {
	return &cobra.Command{
		Use:     "metrics ID",
		Short:   "Show a sandbox's CPU, memory, process and disk use",
		Example: `  opendsecctl sandbox metrics n001sb0001 -o json`,
		Args:    exactArgs(1, "ID"),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.connect()
			if err != nil {
				return err
			}
			m, err := c.SandboxMetrics(cmd.Context(), args[0])
			if err != nil {
				return err
			}
			if a.output == "json" {
				return printJSON(a.stdout, m)
			}
			tw := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
			fmt.Fprintf(tw, "STATE\t%s\n", stateName(m.GetState()))
			fmt.Fprintf(tw, "CPU\t%.1f%% of %g cores (%s total)\n", m.GetCpuUsedPct(), m.GetCpuCount(), time.Duration(m.GetCpuUsageNs()).Round(time.Millisecond))
			fmt.Fprintf(tw, "MEMORY\t%s of %s (cache %s)\n", mib(m.GetMemUsedBytes()), mib(m.GetMemTotalBytes()), mib(m.GetMemCacheBytes()))
			fmt.Fprintf(tw, "PIDS\t%d of %d\n", m.GetPids(), m.GetPidsLimit())
			fmt.Fprintf(tw, "DISK\t%s written (quota %s)\n", mib(m.GetDiskUsedBytes()), mib(m.GetDiskTotalBytes()))
			fmt.Fprintf(tw, "AT\t%s\n", fmtTime(m.GetTimestamp()))
			return tw.Flush()
		},
	}
}

func mib(b int64) string { return fmt.Sprintf("%.1fMiB", float64(b)/(1<<20)) }
