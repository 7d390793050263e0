package gvisor

import (
	"context"
	"encoding/json"
	"fmt"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
)

var _ runtime.StatsReader = (*Runtime)(nil)

// runscEvent is what `runsc events --stats` prints: gVisor's kernel's own
// accounting of the sandbox (its memory, its processes, their CPU time).
type runscEvent struct {
	Data struct {
		CPU struct {
			Usage struct {
				Total uint64 `json:"total"`
			} `json:"usage"`
		} `json:"cpu"`
		Memory struct {
			Cache uint64 `json:"cache"`
			Usage struct {
				Usage uint64 `json:"usage"`
			} `json:"usage"`
		} `json:"memory"`
		Pids struct {
			Current uint64 `json:"current"`
		} `json:"pids"`
	} `json:"data"`
}

// Stats reports the sandbox's use as gVisor's kernel accounts it (`runsc
// events --stats`): memory (page cache included), CPU time and the
// sandbox's own processes (not the sentry's host threads). The writable
// layer is runsc's in-memory overlay, counted in the memory; its own size
// is not reported (DiskUsedBytes 0), DiskTotalBytes is the quota.
func (r *Runtime) Stats(ctx context.Context, id string) (runtime.Stats, error) {
	sb, err := r.get(id)
	if err != nil {
		return runtime.Stats{}, err
	}
	if !sb.started || sb.ended() {
		return runtime.Stats{}, errdefs.New(errdefs.ErrFailedPrecondition, "sandbox %q is not running", id)
	}
	out, err := r.runscOut(ctx, sb, "events", "--stats", id)
	if err != nil {
		return runtime.Stats{}, fmt.Errorf("read sandbox %s stats: %w", id, err)
	}
	var ev runscEvent
	if err := json.Unmarshal(out, &ev); err != nil {
		return runtime.Stats{}, fmt.Errorf("decode runsc events: %w", err)
	}
	pids := sb.st.PidsLimit
	if pids == 0 {
		pids = defaultPids
	}
	return runtime.Stats{
		MemoryBytes:      int64(ev.Data.Memory.Usage.Usage),
		MemoryCacheBytes: min(int64(ev.Data.Memory.Cache), int64(ev.Data.Memory.Usage.Usage)),
		MemoryLimitBytes: sb.st.MemoryMB << 20,
		CPUNanos:         ev.Data.CPU.Usage.Total,
		Pids:             int64(ev.Data.Pids.Current),
		PidsLimit:        pids,
		DiskTotalBytes:   sb.st.DiskMB << 20,
	}, nil
}
