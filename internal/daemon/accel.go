package daemon

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/spf13/cobra"

	"github.com/kernflux/opendsec/internal/config"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/runtime/kvmprobe"
)

// accelCommand prints the accelerator decision VM backends use on this
// host: `opendsec accel [--json]`.
func accelCommand(g *globalFlags) *cobra.Command {
	var asJSON bool
	var pvmKernel, cacheDir string
	c := &cobra.Command{
		Use:   "accel",
		Short: "print which VM accelerator (kvm or tcg) this host gives VMs, and why",
		Long: `accel runs the accelerator detection the node uses: /dev/kvm opens and
creates a VM, the KVM vendor module (kvm_intel/kvm_amd: hardware, kvm_pvm:
PVM), and a timed real-mode probe through KVM_RUN (~200k instructions; under
10 ms of CPU means the CPU executes guest code). Hardware KVM gives kvm; PVM
gives kvm only with a PVM guest kernel (node.pvm_guest_kernel) that passed a
boot probe; everything else gives tcg. The result is cached once per boot in
` + kvmprobe.DefaultCacheDir + `.

It also prints the backend the node takes when a create names none
(node.default_backend; "auto" is microvm where it can run, else container)
and why.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg, err := g.load()
			if err != nil {
				return err
			}
			if !cmd.Flags().Changed("pvm-kernel") {
				pvmKernel = cfg.Node.PVMGuestKernel
			}
			r, err := kvmprobe.Detect(cmd.Context(), kvmprobe.Options{PVMGuestKernel: pvmKernel, CacheDir: cacheDir})
			if err != nil {
				return err
			}
			out := cmd.OutOrStdout()
			if asJSON {
				enc := json.NewEncoder(out)
				enc.SetIndent("", "  ")
				return enc.Encode(r)
			}
			fmt.Fprintf(out, "accel:  %s\nkind:   %s\n", r.Accel, r.Kind)
			if r.Module != "" {
				fmt.Fprintf(out, "module: %s\n", r.Module)
			}
			if r.ProbeInstructions > 0 {
				fmt.Fprintf(out, "probe:  %d instructions in %s of CPU (hardware: under %s)\n", r.ProbeInstructions, r.ProbeDuration.Round(10*time.Microsecond), kvmprobe.HardwareSpeed)
			}
			fmt.Fprintf(out, "reason: %s\n", r.Reason)
			fmt.Fprintln(out, defaultBackendLine(cmd.Context(), cfg, &r))
			return nil
		},
	}
	c.Flags().BoolVar(&asJSON, "json", false, "print the result as JSON")
	c.Flags().StringVar(&pvmKernel, "pvm-kernel", "", "PVM guest kernel to consider (default node.pvm_guest_kernel)")
	c.Flags().StringVar(&cacheDir, "cache-dir", "", "per-boot cache directory (default "+kvmprobe.DefaultCacheDir+")")
	return c
}

// defaultBackendLine is the default backend the node would choose with cfg
// on this host, as "default backend: NAME (why)", or why it would refuse
// to start. Configured backends count as opened (the node refuses to start
// when one does not open).
func defaultBackendLine(ctx context.Context, cfg config.Config, r *kvmprobe.Result) string {
	bcfg, err := cfg.Node.BackendConfigs()
	if err != nil {
		return "default backend: the node would not start: " + err.Error()
	}
	c, rt, err := chooseDefaultBackend(hostBackendFacts(ctx, cfg, runtime.Env{NodeID: cfg.Node.ID}, slices.Sorted(maps.Keys(bcfg)), r, nil))
	if err != nil {
		return "default backend: the node would not start: " + err.Error()
	}
	if rt != nil {
		_ = closeRuntime(rt)
	}
	return c.String()
}
