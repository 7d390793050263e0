package container

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/log"
	"github.com/kernflux/opendsec/internal/runtime"
)

var _ runtime.Reclaimer = (*Runtime)(nil)

// Reclaim, and why it works on a frozen cgroup. The kernel reclaims a
// cgroup's memory in the context of whoever asks, not of its tasks, so a
// frozen sandbox can be emptied without running any of it:
//
//   - cgroup v2: memory.reclaim is written with the bytes charged; the
//     kernel reclaims what it can (anonymous pages only to swap) and says
//     EAGAIN when it could not reach the amount, which is expected here.
//     memory.max is never lowered on v2: a write there that cannot be met
//     OOM-kills the sandbox.
//   - cgroup v1: with swap present, memory.limit_in_bytes is lowered step
//     by step (each step to half the charge): the write reclaims until the
//     charge is under the new limit and answers EBUSY when reclaim stops
//     making progress, which ends the steps (v1 never OOM-kills for it).
//     Moving a page to swap leaves memory.memsw.usage (RAM + swap) as it
//     was, so the sandbox's memsw limit (equal to its memory limit: no
//     swap escape while running) does not stop it. Then memory.force_empty
//     drops what page cache is left, and the original limit goes back at
//     once, still frozen: frozen tasks fault nothing in, so a lower limit
//     would hold nothing back, and a swapped-out page stays out until a
//     task touches it after the resume. The original limit is written to
//     the bundle (reclaimLimitFile) before the first step and removed after
//     the restore, so a node killed in between puts it back at Resume or
//     Recover.
//
// Without swap only page cache can go (anonymous memory has nowhere to
// go); the result's Note says so.
const (
	// reclaimLimitFile in the bundle holds the v1 memory limit a Reclaim
	// lowered, until it is restored.
	reclaimLimitFile = "reclaim-memory-limit"
	// reclaimFloor is where the v1 steps stop: below it lies what the
	// kernel keeps charged (page tables, kernel stacks, slab).
	reclaimFloor = 1 << 20
	// reclaimMaxSteps bounds the v1 steps (halving 64 GiB to the floor
	// takes 16).
	reclaimMaxSteps = 24
)

// NoSwapNote is the Note of a reclaim on a node without swap.
const NoSwapNote = "the node has no swap, so only page cache was freed and anonymous memory stayed in RAM; set up swap (the quickstart makes zram swap, see docs/operations.md)"

// Reclaim pushes a paused sandbox's memory out of RAM (see above).
func (r *Runtime) Reclaim(ctx context.Context, id string) (runtime.ReclaimStats, error) {
	var rs runtime.ReclaimStats
	sb, err := r.lock(id)
	if err != nil {
		return rs, err
	}
	defer sb.op.Unlock()
	if err := r.running(sb); err != nil {
		return rs, err
	}
	frozen, err := r.cg.frozen(sb.st.CgroupPath)
	if err != nil {
		return rs, freezerErr("read freezer state", err)
	}
	if !frozen {
		return rs, errdefs.New(errdefs.ErrFailedPrecondition, "sandbox %q is not paused; pause it before reclaiming its memory", id)
	}
	if rs.Before, err = r.cg.memoryCharged(sb.st.CgroupPath); err != nil {
		return rs, fmt.Errorf("read sandbox memory: %w", err)
	}
	swapTotal, swapFree := hostSwap()
	if r.cg.v2 {
		err = r.cg.reclaimV2(sb.st.CgroupPath, rs.Before)
	} else {
		err = r.reclaimV1(ctx, sb, swapTotal > 0)
	}
	if err != nil {
		return rs, fmt.Errorf("reclaim memory of sandbox %s: %w", id, err)
	}
	if rs.After, err = r.cg.memoryCharged(sb.st.CgroupPath); err != nil {
		return rs, fmt.Errorf("read sandbox memory: %w", err)
	}
	switch {
	case swapTotal == 0:
		rs.Note = NoSwapNote
	case swapFree < rs.Before-rs.Freed():
		rs.Note = fmt.Sprintf("the node's swap is nearly full (%d of %d bytes free), so not everything could be pushed out", swapFree, swapTotal)
	}
	return rs, nil
}

// memoryCharged is the memory the cgroup path is charged in RAM.
func (m cgroupMounts) memoryCharged(path string) (int64, error) {
	if m.v2 {
		return readInt(filepath.Join(m.unified, path, "memory.current"))
	}
	return readInt(filepath.Join(m.v1["memory"], path, "memory.usage_in_bytes"))
}

// reclaimV2 asks the kernel to reclaim want bytes of the cgroup path.
func (m cgroupMounts) reclaimV2(path string, want int64) error {
	if want <= 0 {
		return nil
	}
	err := os.WriteFile(filepath.Join(m.unified, path, "memory.reclaim"), []byte(strconv.FormatInt(want, 10)), 0)
	if err != nil && !errors.Is(err, unix.EAGAIN) {
		return fmt.Errorf("write memory.reclaim: %w", unwrapPath(err))
	}
	return nil
}

// reclaimV1 lowers the limit step by step (with swap), empties the page
// cache and restores the limit. The caller holds sb.op.
func (r *Runtime) reclaimV1(ctx context.Context, sb *sandbox, swap bool) error {
	dir := filepath.Join(r.cg.v1["memory"], sb.st.CgroupPath)
	limitFile := filepath.Join(dir, "memory.limit_in_bytes")
	if swap {
		if err := r.restoreMemoryLimit(ctx, sb); err != nil {
			return err
		}
		orig, err := os.ReadFile(limitFile)
		if err != nil {
			return fmt.Errorf("read memory.limit_in_bytes: %w", unwrapPath(err))
		}
		saved := filepath.Join(sb.st.Bundle, reclaimLimitFile)
		if err := writeFileSync(saved, orig); err != nil {
			return fmt.Errorf("save the memory limit: %w", err)
		}
		stepErr := stepDownLimit(ctx, dir)
		if err := r.restoreMemoryLimit(ctx, sb); err != nil {
			return errors.Join(stepErr, err)
		}
		if stepErr != nil {
			return stepErr
		}
	}
	// force_empty reclaims everything it can (page cache; anonymous memory
	// to swap) and returns once no more comes off.
	if err := os.WriteFile(filepath.Join(dir, "memory.force_empty"), []byte("0"), 0); err != nil && !errors.Is(err, unix.EBUSY) {
		return fmt.Errorf("write memory.force_empty: %w", unwrapPath(err))
	}
	return nil
}

// stepDownLimit halves the v1 memory limit of the cgroup dir towards its
// charge until the kernel can reclaim no more (EBUSY) or the floor.
func stepDownLimit(ctx context.Context, dir string) error {
	limitFile := filepath.Join(dir, "memory.limit_in_bytes")
	for range reclaimMaxSteps {
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("reclaim memory: %w", err)
		}
		cur, err := readInt(filepath.Join(dir, "memory.usage_in_bytes"))
		if err != nil {
			return fmt.Errorf("read memory.usage_in_bytes: %w", unwrapPath(err))
		}
		if cur <= reclaimFloor {
			return nil
		}
		target := max(cur/2, reclaimFloor) &^ (1<<12 - 1)
		err = os.WriteFile(limitFile, []byte(strconv.FormatInt(target, 10)), 0)
		if errors.Is(err, unix.EBUSY) {
			return nil // reclaim made no more progress
		}
		if err != nil {
			return fmt.Errorf("lower memory.limit_in_bytes: %w", unwrapPath(err))
		}
	}
	return nil
}

// restoreMemoryLimit writes back the v1 memory limit a Reclaim saved in the
// bundle, if one is there, and removes the record. The caller holds sb.op.
func (r *Runtime) restoreMemoryLimit(ctx context.Context, sb *sandbox) error {
	saved := filepath.Join(sb.st.Bundle, reclaimLimitFile)
	b, err := os.ReadFile(saved)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("read the saved memory limit: %w", err)
	}
	v := strings.TrimSpace(string(b))
	if _, err := strconv.ParseInt(v, 10, 64); err != nil {
		return fmt.Errorf("saved memory limit %q: %w", v, err)
	}
	dir := filepath.Join(r.cg.v1["memory"], sb.st.CgroupPath)
	if err := os.WriteFile(filepath.Join(dir, "memory.limit_in_bytes"), []byte(v), 0); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("restore memory.limit_in_bytes: %w", unwrapPath(err))
	}
	if err := os.Remove(saved); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("remove the saved memory limit: %w", err)
	}
	log.G(ctx).Debug("sandbox memory limit restored after reclaim", log.SandboxID(sb.id), "limit", v)
	return nil
}

// hostSwap returns SwapTotal and SwapFree of /proc/meminfo in bytes.
func hostSwap() (total, free int64) {
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		return 0, 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), ":")
		if !ok {
			continue
		}
		fs := strings.Fields(v)
		if len(fs) == 0 {
			continue
		}
		n, err := strconv.ParseInt(fs[0], 10, 64)
		if err != nil {
			continue
		}
		switch k {
		case "SwapTotal":
			total = n << 10
		case "SwapFree":
			free = n << 10
		}
	}
	return total, free
}

// writeFileSync writes b to path and syncs it and its directory (the
// file's name survives a crash too).
func writeFileSync(path string, b []byte) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return err
	}
	if _, err := f.Write(b); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	d, err := os.Open(filepath.Dir(path))
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}

// unwrapPath drops the host path from a file error (messages reach users).
func unwrapPath(err error) error {
	var pe *os.PathError
	if errors.As(err, &pe) {
		return pe.Err
	}
	return err
}
