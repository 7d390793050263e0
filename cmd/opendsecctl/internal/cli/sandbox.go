package cli

import (
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/schollz/progressbar/v3"
	"github.com/spf13/cobra"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/internal/sandboxspec"
	opendsec "github.com/kernflux/opendsec/sdk/go"
)

// parseKV turns ["K=V", ...] into a map; flag names the flag for errors.
func parseKV(flag string, pairs []string) (map[string]string, error) {
	if len(pairs) == 0 {
		return nil, nil
	}
	m := make(map[string]string, len(pairs))
	for _, p := range pairs {
		k, v, ok := strings.Cut(p, "=")
		if !ok || k == "" {
			return nil, usagef("--%s: %q is not KEY=VALUE", flag, p)
		}
		m[k] = v
	}
	return m, nil
}

// parseSeconds reads "5m", "90s" or a plain number of seconds.
func parseSeconds(flag, s string) (int64, error) {
	if s == "" {
		return 0, nil
	}
	if n, err := strconv.ParseInt(s, 10, 64); err == nil {
		if n < 0 {
			return 0, usagef("--%s: must not be negative", flag)
		}
		return n, nil
	}
	d, err := time.ParseDuration(s)
	if err != nil {
		return 0, usagef("--%s: %q is not a duration; use e.g. 90s, 5m or 1h", flag, s)
	}
	if d < 0 {
		return 0, usagef("--%s: must not be negative", flag)
	}
	return int64((d + time.Second - 1) / time.Second), nil
}

func (a *app) createCommand() *cobra.Command {
	var (
		spec          opendsecv1.SandboxSpec
		timeout, idle string
		env, labels   []string
		count         int
		quiet         bool
		memoryMB      int64
		network       networkFlags
		skipWarmPool  bool
	)
	cmd := &cobra.Command{
		Use:   "create (--image IMAGE | --snapshot ID) [flags]",
		Short: "Create sandboxes and wait until they are ready",
		Example: `  opendsecctl sandbox create --image root/py:3.11 --timeout 10m --label team=rl
  opendsecctl sandbox create --image root/busybox --count 100 -q
  opendsecctl sandbox create --image root/busybox --skip-warm-pool -o json
  opendsecctl sandbox create --image root/py:3.11 --rule-set pypi --allow 10.0.0.0/8:443/tcp --allow-domain example.com:443`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			var err error
			if spec.Image == "" && spec.Snapshot == "" {
				return usagef("--image: required (or --snapshot), e.g. --image root/busybox")
			}
			if spec.Image != "" && spec.Snapshot != "" {
				return usagef("--snapshot: give either --image or --snapshot, not both")
			}
			if cmd.Flags().Changed("memory-mb") {
				spec.MemoryMb = &memoryMB
			}
			if spec.TimeoutSeconds, err = parseSeconds("timeout", timeout); err != nil {
				return err
			}
			if spec.IdleTimeoutSeconds, err = parseSeconds("idle-timeout", idle); err != nil {
				return err
			}
			if spec.Env, err = parseKV("env", env); err != nil {
				return err
			}
			if spec.Labels, err = parseKV("label", labels); err != nil {
				return err
			}
			if network.set() {
				if spec.Network, err = network.policy(); err != nil {
					return err
				}
			}
			if count < 1 || count > opendsec.MaxBatch {
				return usagef("--count: must be between 1 and %d", opendsec.MaxBatch)
			}
			c, err := a.connect()
			if err != nil {
				return err
			}
			opts := opendsec.CreateOptions{SkipWarmPool: skipWarmPool}
			if count == 1 {
				sb, err := c.CreateSandboxWith(cmd.Context(), &spec, opts)
				if err != nil {
					return err
				}
				return a.printCreated([]*opendsec.Sandbox{sb}, quiet)
			}
			return a.batchCreate(cmd, c, &spec, count, opts, quiet)
		},
	}
	f := cmd.Flags()
	f.StringVar(&spec.Image, "image", "", "image name, e.g. root/busybox or root/py:3.11 (required unless --snapshot)")
	f.StringVar(&spec.Snapshot, "snapshot", "", "start from this snapshot ID instead of an image (unset flags take the snapshot's values)")
	f.StringVar(&spec.Backend, "backend", "", "container, microvm or vm (default: the node's)")
	f.Float64Var(&spec.Cpu, "cpu", 0, fmt.Sprintf("CPU cores, fractions allowed (default %g)", sandboxspec.DefaultCPU))
	f.Int64Var(&memoryMB, "memory-mb", 0, fmt.Sprintf("memory limit in MiB, at least %d (default %d)", sandboxspec.MinMemoryMB, sandboxspec.DefaultMemoryMB))
	f.StringVar(&timeout, "timeout", "", fmt.Sprintf("lifetime, e.g. 5m or 3600 (seconds) (default %dm, at most %dh)", sandboxspec.DefaultTimeoutSec/60, sandboxspec.MaxTimeoutSec/3600))
	f.StringVar(&idle, "idle-timeout", "", "stop after this long without activity (default off)")
	f.StringArrayVar(&env, "env", nil, "environment variable KEY=VALUE (repeatable)")
	f.StringArrayVar(&labels, "label", nil, "label KEY=VALUE (repeatable)")
	f.StringVar(&spec.User, "user", "", "default user for processes (default root)")
	f.StringVar(&spec.TaskId, "task-id", "", "task the sandbox belongs to")
	f.StringVar(&spec.OnTimeout, "on-timeout", "", "what the lifetime or idle timeout does: stop, pause or pause_filesystem (default stop; a paused sandbox resumes on the next call into it; pause_filesystem keeps only its files)")
	f.BoolVar(&spec.AutoPause, "auto-pause", false, "pause instead of stopping when a timeout ends (alias of --on-timeout pause)")
	f.StringVar(&spec.Workdir, "workdir", "", "working directory for processes")
	f.StringVar(&spec.CpuClass, "cpu-class", "", "latency (default) or best_effort: best_effort runs under SCHED_IDLE on CPU time latency sandboxes leave")
	f.Int64Var(&spec.PidsLimit, "pids-limit", 0, fmt.Sprintf("maximum number of processes, at least %d (default %d)", sandboxspec.MinPidsLimit, sandboxspec.DefaultPidsLimit))
	f.IntVarP(&count, "count", "n", 1, "number of sandboxes to create (progress on stderr when > 1)")
	f.BoolVarP(&quiet, "quiet", "q", false, "print only the IDs")
	f.BoolVar(&skipWarmPool, "skip-warm-pool", false, "make the sandboxes from scratch, never from the node's warm pool of prestarted sandboxes")
	network.register(cmd)
	return cmd
}

func (a *app) printCreated(sbs []*opendsec.Sandbox, quiet bool) error {
	switch {
	case a.output == "json" && len(sbs) == 1:
		return printJSON(a.stdout, sbs[0])
	case a.output == "json":
		return printJSON(a.stdout, &opendsecv1.ListSandboxesResponse{Sandboxes: sbs})
	case quiet:
		for _, sb := range sbs {
			fmt.Fprintln(a.stdout, sb.GetId())
		}
		return nil
	}
	return printSandboxTable(a.stdout, sbs)
}

// batchCreate makes count sandboxes with a progress bar on stderr and
// reports each failed item; it fails when any item failed.
func (a *app) batchCreate(cmd *cobra.Command, c *opendsec.Client, spec *opendsecv1.SandboxSpec, count int, opts opendsec.CreateOptions, quiet bool) error {
	bar := progressbar.NewOptions(count,
		progressbar.OptionSetWriter(a.stderr),
		progressbar.OptionSetDescription("creating"),
		progressbar.OptionShowCount(),
		progressbar.OptionSetElapsedTime(true),
		progressbar.OptionSetPredictTime(false),
		progressbar.OptionThrottle(100*time.Millisecond),
		progressbar.OptionOnCompletion(func() { fmt.Fprintln(a.stderr) }),
	)
	var (
		mu      sync.Mutex
		created = make([]*opendsec.Sandbox, count)
		failed  []opendsec.BatchResult
	)
	err := c.BatchCreateWith(cmd.Context(), spec, count, opts, func(r opendsec.BatchResult) {
		mu.Lock()
		defer mu.Unlock()
		if r.Err != nil {
			failed = append(failed, r)
		} else {
			created[r.Index] = r.Sandbox
		}
		_ = bar.Add(1)
	})
	_ = bar.Finish()
	var ok []*opendsec.Sandbox
	for _, sb := range created {
		if sb != nil {
			ok = append(ok, sb)
		}
	}
	if len(ok) > 0 {
		if perr := a.printCreated(ok, quiet); perr != nil {
			return perr
		}
	}
	if err != nil {
		return err
	}
	for _, r := range failed {
		fmt.Fprintf(a.stderr, "error: sandbox %d: %s\n", r.Index, messageOf(r.Err))
	}
	if len(failed) > 0 {
		fmt.Fprintf(a.stderr, "%d of %d sandboxes created, %d failed\n", len(ok), count, len(failed))
		return &exitError{code: 1}
	}
	return nil
}

// messageOf returns the people-facing message of err.
func messageOf(err error) string {
	if e, ok := err.(*opendsec.Error); ok && e.Message != "" {
		return e.Message
	}
	return err.Error()
}

func (a *app) listCommand() *cobra.Command {
	var (
		labels []string
		filter opendsec.ListFilter
		quiet  bool
	)
	cmd := &cobra.Command{
		Use:     "list [flags]",
		Aliases: []string{"ls"},
		Short:   "List sandboxes",
		Example: `  opendsecctl sandbox list --label team=rl
  opendsecctl sandbox list --task-id t1 -o json`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			var err error
			if filter.Labels, err = parseKV("label", labels); err != nil {
				return err
			}
			c, err := a.connect()
			if err != nil {
				return err
			}
			sbs, err := c.ListSandboxes(cmd.Context(), filter)
			if err != nil {
				return err
			}
			switch {
			case a.output == "json":
				return printJSON(a.stdout, &opendsecv1.ListSandboxesResponse{Sandboxes: sbs})
			case quiet:
				for _, sb := range sbs {
					fmt.Fprintln(a.stdout, sb.GetId())
				}
				return nil
			}
			return printSandboxTable(a.stdout, sbs)
		},
	}
	f := cmd.Flags()
	f.StringArrayVar(&labels, "label", nil, "only sandboxes with label KEY=VALUE (repeatable)")
	f.StringVar(&filter.TaskID, "task-id", "", "only sandboxes of this task")
	f.StringVar(&filter.Backend, "backend", "", "only sandboxes of this backend")
	f.BoolVarP(&quiet, "quiet", "q", false, "print only the IDs")
	return cmd
}

func (a *app) getCommand() *cobra.Command {
	return &cobra.Command{
		Use:     "get ID",
		Short:   "Show one sandbox",
		Example: `  opendsecctl sandbox get n001sb0001 -o json`,
		Args:    exactArgs(1, "ID"),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.connect()
			if err != nil {
				return err
			}
			sb, err := c.GetSandbox(cmd.Context(), args[0])
			if err != nil {
				return err
			}
			if a.output == "json" {
				return printJSON(a.stdout, sb)
			}
			return printSandboxDetail(a.stdout, sb)
		},
	}
}

func (a *app) stopCommand() *cobra.Command {
	return &cobra.Command{
		Use:     "stop ID...",
		Aliases: []string{"rm"},
		Short:   "Stop and delete sandboxes",
		Example: `  opendsecctl sandbox stop n001sb0001 n001sb0002
  opendsecctl sandbox list -q --label run=7 | xargs opendsecctl sandbox stop`,
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) == 0 {
				return usagef("sandbox stop: give at least one sandbox ID")
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.connect()
			if err != nil {
				return err
			}
			// Stop every sandbox even when one fails; report each failure.
			var failed []error
			for _, id := range args {
				if err := c.StopSandbox(cmd.Context(), id); err != nil {
					failed = append(failed, err)
					if len(args) > 1 {
						fmt.Fprintf(a.stderr, "error: stop %s: %s\n", id, messageOf(err))
					}
					continue
				}
				fmt.Fprintln(a.stdout, id)
			}
			switch {
			case len(failed) == 0:
				return nil
			case len(args) == 1:
				return failed[0]
			}
			return &exitError{code: 1}
		},
	}
}

func (a *app) setTimeoutCommand() *cobra.Command {
	return &cobra.Command{
		Use:     "set-timeout ID DURATION",
		Short:   "Make a sandbox's lifetime end DURATION from now",
		Example: `  opendsecctl sandbox set-timeout n001sb0001 1h`,
		Args:    exactArgs(2, "ID DURATION"),
		RunE: func(cmd *cobra.Command, args []string) error {
			secs, err := parseSeconds("DURATION", args[1])
			if err != nil {
				return err
			}
			if secs == 0 {
				return usagef("DURATION: must be at least 1s")
			}
			c, err := a.connect()
			if err != nil {
				return err
			}
			sb, err := c.SetTimeout(cmd.Context(), args[0], time.Duration(secs)*time.Second)
			if err != nil {
				return err
			}
			if a.output == "json" {
				return printJSON(a.stdout, sb)
			}
			if sb.GetState() == opendsecv1.SandboxState_SANDBOX_STATE_PAUSED {
				// Its lifetime clock is stopped: it starts at the resume.
				fmt.Fprintf(a.stdout, "%s is paused; it expires %s after it resumes\n", sb.GetId(), time.Duration(secs)*time.Second)
				return nil
			}
			fmt.Fprintf(a.stdout, "%s expires at %s\n", sb.GetId(), fmtTime(sb.GetExpiresAt()))
			return nil
		},
	}
}

// exactArgs is cobra.ExactArgs with a usage error naming the arguments.
func exactArgs(n int, names string) cobra.PositionalArgs {
	return func(cmd *cobra.Command, args []string) error {
		if len(args) != n {
			return usagef("%s: takes %s, got %d argument(s)", cmd.CommandPath(), names, len(args))
		}
		return nil
	}
}
