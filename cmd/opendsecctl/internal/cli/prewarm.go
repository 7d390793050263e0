package cli

import (
	"fmt"
	"time"

	"github.com/spf13/cobra"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/internal/sandboxspec"
	opendsec "github.com/kernflux/opendsec/sdk/go"
)

// prewarmCommand asks the warm pool to hold prestarted sandboxes of a
// shape. It takes create's shape flags (what a prestarted sandbox fixes);
// env, labels, timeouts and the task belong to each create and are not
// asked for.
func (a *app) prewarmCommand() *cobra.Command {
	var (
		spec     opendsecv1.SandboxSpec
		ttl      string
		count    int
		memoryMB int64
		network  networkFlags
		wait     bool
	)
	cmd := &cobra.Command{
		Use:   "prewarm --image IMAGE --count N [flags]",
		Short: "Have the warm pool hold N prestarted sandboxes of a shape for the creates to come",
		Long: `Asks the node's warm pool to hold N prestarted sandboxes of the shape the
flags give (image, backend, cpu, memory, pids limit, user, workdir, network),
so that the creates of that shape that follow (sandbox create --count N with
the same shape flags) each take one instead of starting from scratch. Each
create of the shape consumes one; after that, or after --ttl, the pool goes
back to its normal size. Prints how many the pool will hold, fewer than N
when the node's capacity or node.warm_pool.max_sandboxes does not allow more
(the reason follows).`,
		Example: `  opendsecctl sandbox prewarm --image root/busybox --cpu 0.1 --memory-mb 128 --count 300 --wait
  opendsecctl sandbox create --image root/busybox --cpu 0.1 --memory-mb 128 --count 300 -q`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if spec.Image == "" {
				return usagef("--image: required, e.g. --image root/busybox")
			}
			if !cmd.Flags().Changed("count") {
				return usagef("--count: required, the number of sandboxes to hold")
			}
			if count < 1 || count > opendsec.MaxBatch {
				return usagef("--count: must be between 1 and the node's node.warm_pool.max_sandboxes")
			}
			if cmd.Flags().Changed("memory-mb") {
				spec.MemoryMb = &memoryMB
			}
			secs, err := parseSeconds("ttl", ttl)
			if err != nil {
				return err
			}
			if network.set() {
				if spec.Network, err = network.policy(); err != nil {
					return err
				}
			}
			c, err := a.connect()
			if err != nil {
				return err
			}
			res, err := c.Prewarm(cmd.Context(), &spec, count, opendsec.PrewarmOptions{TTL: time.Duration(secs) * time.Second, Wait: wait})
			if err != nil {
				return err
			}
			if a.output == "json" {
				return printJSON(a.stdout, res)
			}
			fmt.Fprintf(a.stdout, "held %d of %d (%d ready) for %ds\n", res.GetHeld(), count, res.GetReady(), res.GetTtlSeconds())
			if res.GetReason() != "" {
				fmt.Fprintf(a.stdout, "fewer: %s\n", res.GetReason())
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&spec.Image, "image", "", "image name, e.g. root/busybox (required)")
	f.StringVar(&spec.Backend, "backend", "", "container, microvm or vm (default: the node's)")
	f.Float64Var(&spec.Cpu, "cpu", 0, fmt.Sprintf("CPU cores, fractions allowed (default %g)", sandboxspec.DefaultCPU))
	f.Int64Var(&memoryMB, "memory-mb", 0, fmt.Sprintf("memory limit in MiB (default %d)", sandboxspec.DefaultMemoryMB))
	f.StringVar(&spec.User, "user", "", "default user for processes (default root)")
	f.StringVar(&spec.Workdir, "workdir", "", "working directory for processes")
	f.Int64Var(&spec.PidsLimit, "pids-limit", 0, fmt.Sprintf("maximum number of processes (default %d)", sandboxspec.DefaultPidsLimit))
	f.IntVarP(&count, "count", "n", 0, "number of prestarted sandboxes to hold (required)")
	f.StringVar(&ttl, "ttl", "", "how long to hold them if no create takes them, e.g. 5m (default: the pool's idle TTL; at most 24h)")
	f.BoolVar(&wait, "wait", false, "return only once the pool holds them")
	network.register(cmd)
	return cmd
}
