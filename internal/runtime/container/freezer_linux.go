package container

import (
	"context"
	"errors"
	"fmt"
	iofs "io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/log"
)

// Freezing, and why it retries. A freeze asks every task of the cgroup to
// stop at its next return to user space; a task asleep in the kernel in a
// way the freezer cannot interrupt (D state: waiting on a disk read, a page
// fault, a FUSE or NFS server) freezes only when that sleep ends. On cgroup
// v1 there is more: the freezer can stay FREEZING while new tasks keep
// appearing (fork, clone, an exec joining the cgroup) and it recomputes
// FROZEN only when freezer.state is read. So a v1 freeze does what runc's
// does (libcontainer/cgroups/fs/freezer.go): write FROZEN and read the state
// back, again and again (here with a delay that doubles from freezePollMin
// to freezePollMax), and when a round of that does not end FREEZING, thaw
// for freezeThawPause and start over; rounds grow from freezeRoundMin to
// freezeRoundMax, so a task in a long kernel sleep gets longer to come
// out of it. v2's cgroup.freeze has none of v1's races: it is written once
// and cgroup.events' "frozen 1" is awaited with the same backoff. Either way
// the whole freeze is bounded by freezeTimeout and ctx; past that the
// cgroup is thawed again (never left half-frozen) and the error names the
// tasks that did not freeze.
var freezeTimeout = 10 * time.Second // a var for tests

const (
	freezePollMin   = 20 * time.Microsecond
	freezePollMax   = 5 * time.Millisecond
	freezeRoundMin  = 50 * time.Millisecond
	freezeRoundMax  = time.Second
	freezeThawPause = 10 * time.Millisecond
	// maxStuckListed bounds the tasks a failed freeze names.
	maxStuckListed = 8
)

// errFreezeBudget is the cause of a freeze's context ending at freezeTimeout
// (rather than at the caller's deadline).
var errFreezeBudget = errors.New("freeze budget used up")

// freezeStats describes one freeze, for logs and tests.
type freezeStats struct {
	polls  int           // state reads that did not say frozen
	thaws  int           // rounds given up: thawed and frozen again
	took   time.Duration // from the first write to the end
	heldBy string        // the tasks that had not frozen when the first round was given up
}

// onFreeze, if set, sees every freeze's stats (tests).
var onFreeze func(freezeStats)

// freezerFile returns the file that freezes the cgroup path and the value
// written to freeze or thaw it: cgroup.freeze ("1"/"0") on v2,
// freezer.state ("FROZEN"/"THAWED") on v1.
func (m cgroupMounts) freezerFile(path string, freeze bool) (string, string, error) {
	if m.v2 {
		v := "0"
		if freeze {
			v = "1"
		}
		return filepath.Join(m.unified, path, "cgroup.freeze"), v, nil
	}
	mnt, ok := m.v1["freezer"]
	if !ok {
		return "", "", errdefs.New(errdefs.ErrFailedPrecondition, "the cgroup v1 freezer controller is not mounted; mount it to pause sandboxes")
	}
	v := "THAWED"
	if freeze {
		v = "FROZEN"
	}
	return filepath.Join(mnt, path, "freezer.state"), v, nil
}

// frozen reports whether the cgroup path is completely frozen.
func (m cgroupMounts) frozen(path string) (bool, error) {
	if m.v2 {
		b, err := os.ReadFile(filepath.Join(m.unified, path, "cgroup.events"))
		if err != nil {
			return false, err
		}
		for _, line := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(line, "frozen "); ok {
				return strings.TrimSpace(v) == "1", nil
			}
		}
		return false, errors.New("no frozen field in cgroup.events")
	}
	state, err := m.v1State(path)
	return state == "FROZEN", err
}

// v1State reads the v1 freezer state of path: THAWED, FREEZING or FROZEN.
// Reading it is what makes the kernel move FREEZING to FROZEN.
// thawed reports whether the cgroup path is known to be thawed (not
// frozen, not freezing); false when unsure.
func (m cgroupMounts) thawed(path string) bool {
	if m.v2 {
		b, err := os.ReadFile(filepath.Join(m.unified, path, "cgroup.freeze"))
		return err == nil && strings.TrimSpace(string(b)) == "0"
	}
	state, err := m.v1State(path)
	return err == nil && state == "THAWED"
}

func (m cgroupMounts) v1State(path string) (string, error) {
	b, err := os.ReadFile(filepath.Join(m.v1["freezer"], path, "freezer.state"))
	return strings.TrimSpace(string(b)), err
}

// setFrozen freezes or thaws every task of the cgroup path by writing the
// freezer directly (no runc process: a pause costs a few syscalls). runc
// reads the same freezer, so `runc state` says "paused" afterwards and
// `runc resume` thaws. A freeze returns once every task is frozen; if that
// takes longer than freezeTimeout or ctx ends, the cgroup is thawed again
// and the error names the tasks that did not freeze.
func (m cgroupMounts) setFrozen(ctx context.Context, path string, freeze bool) error {
	if !freeze {
		file, val, err := m.freezerFile(path, false)
		if err != nil {
			return err
		}
		return writeFreezer(file, val)
	}
	st, err := m.freeze(ctx, path)
	if onFreeze != nil {
		onFreeze(st)
	}
	if err == nil && st.thaws > 0 {
		log.G(ctx).Info("cgroup froze after retries", "cgroup", path, "thaws", st.thaws, "polls", st.polls, "took", st.took, "first_held_by", st.heldBy)
	}
	return err
}

// writeFreezer writes val to the freezer file. A missing cgroup is a failed
// precondition; no error names the host path (callers show it to users).
func writeFreezer(file, val string) error {
	if err := os.WriteFile(file, []byte(val), 0); err != nil {
		return freezerErr("write "+filepath.Base(file), err)
	}
	return nil
}

// freezerErr wraps an error from a freezer file without its host path.
func freezerErr(what string, err error) error {
	if errors.Is(err, os.ErrNotExist) {
		return errdefs.New(errdefs.ErrFailedPrecondition, "sandbox has no freezer cgroup (not started or already stopped)")
	}
	var pe *iofs.PathError
	if errors.As(err, &pe) {
		err = pe.Err
	}
	return fmt.Errorf("%s: %w", what, err)
}

// freeze freezes the cgroup path (see the comment on freezeTimeout).
func (m cgroupMounts) freeze(ctx context.Context, path string) (st freezeStats, err error) {
	file, val, err := m.freezerFile(path, true)
	if err != nil {
		return st, err
	}
	if err := ctx.Err(); err != nil {
		return st, fmt.Errorf("freeze sandbox: %w", err)
	}
	ctx, cancel := context.WithTimeoutCause(ctx, freezeTimeout, errFreezeBudget)
	defer cancel()
	start := time.Now()
	defer func() {
		st.took = time.Since(start)
		if err != nil {
			// Never leave the cgroup FREEZING or half-frozen.
			m.thaw(path)
		}
	}()
	if err := writeFreezer(file, val); err != nil {
		return st, err
	}
	for round := 0; ; round++ {
		if round > 0 {
			// v1 only: thaw, let the tasks run on a moment (a fork or an
			// exec finishes), and start over.
			st.thaws++
			if st.thaws == 1 {
				tasks := m.unfrozenTasks(path)
				m.thaw(path)
				st.heldBy = describeStuck(stillBlocked("/proc", tasks))
			}
			m.thaw(path)
			if err := sleepCtx(ctx, freezeThawPause); err != nil {
				// Canceled (a deadline never ends a thaw, see below):
				// nothing is frozen to tell the stuck tasks by.
				return st, fmt.Errorf("not every process of the sandbox froze before the request ended, so it was thawed again: %w", err)
			}
			if err := writeFreezer(file, val); err != nil {
				return st, err
			}
		}
		// v2 keeps freezing until ctx ends: its round has no end.
		roundEnd := time.Now().Add(min(freezeRoundMin<<min(round, 10), freezeRoundMax))
		for delay := freezePollMin; ; delay = min(delay*2, freezePollMax) {
			ok, err := m.frozen(path)
			if err != nil {
				return st, freezerErr("read freezer state", err)
			}
			if ok {
				return st, nil
			}
			st.polls++
			if !m.v2 && time.Now().After(roundEnd) {
				dl, _ := ctx.Deadline()
				if time.Until(dl) > freezeThawPause+freezeRoundMin {
					break
				}
				// Too little time left to start over: the last round runs
				// to the deadline, so a failed freeze ends FREEZING and
				// the tasks that did not freeze can be told apart.
				roundEnd = dl
			}
			if err := sleepCtx(ctx, delay); err != nil {
				return st, m.freezeFailed(ctx, path, st, start)
			}
			if !m.v2 {
				// v1 retries the tasks that were running a moment ago
				// (or that appeared since) when FROZEN is written again.
				if err := writeFreezer(file, val); err != nil {
					return st, err
				}
			}
		}
	}
}

// sleepCtx waits d or until ctx ends (then it returns ctx's error).
func sleepCtx(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// freezeFailed builds the error of a freeze whose ctx ended and thaws the
// cgroup: it names the tasks that had not frozen (see unfrozenTasks and
// stillBlocked) and logs them with the cgroup's host path. Past
// freezeTimeout it is unavailable (retrying later usually works); past the
// caller's deadline it wraps the caller's context error.
func (m cgroupMounts) freezeFailed(ctx context.Context, path string, st freezeStats, start time.Time) error {
	tasks := m.unfrozenTasks(path)
	m.thaw(path)
	list := describeStuck(stillBlocked("/proc", tasks))
	log.G(ctx).Warn("cgroup did not freeze; thawed it again", "cgroup", path, "took", time.Since(start), "thaws", st.thaws, "polls", st.polls, "not_frozen", list)
	if errors.Is(context.Cause(ctx), errFreezeBudget) {
		return errdefs.New(errdefs.ErrUnavailable,
			"not every process of the sandbox froze within %s, so it was thawed again; retry the pause (a process blocked in the kernel, on disk I/O or a FUSE or network filesystem, freezes only when that call returns): %s",
			freezeTimeout, list)
	}
	when := "before the request's deadline"
	if errors.Is(ctx.Err(), context.Canceled) {
		when = "before the request was canceled"
	}
	return fmt.Errorf("not every process of the sandbox froze %s, so it was thawed again; retry the pause with more time (%s): %w", when, list, ctx.Err())
}

func (m cgroupMounts) thaw(path string) {
	if file, val, err := m.freezerFile(path, false); err == nil {
		_ = os.WriteFile(file, []byte(val), 0)
	}
}

// stuckTask is a thread of a cgroup that is not frozen, as /proc shows it.
type stuckTask struct {
	pid   int    // host thread id
	nspid int    // the same in the sandbox's pid namespace; 0 if unknown
	comm  string // its command name
	state string // the state letter of /proc/<pid>/stat (R, S, D, ...)
	wchan string // the kernel function it sleeps in; "" if unknown
}

func (t stuckTask) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "pid %d", t.pid)
	if t.nspid > 0 {
		fmt.Fprintf(&b, " (pid %d in the sandbox)", t.nspid)
	}
	fmt.Fprintf(&b, " %q state %s", t.comm, t.state)
	if t.wchan != "" {
		fmt.Fprintf(&b, " in %s", t.wchan)
	}
	return b.String()
}

// describeStuck lists at most maxStuckListed of tasks, for a message.
func describeStuck(tasks []stuckTask) string {
	if len(tasks) == 0 {
		return "every task looked frozen when checked, but the kernel had not yet reported the cgroup frozen"
	}
	parts := make([]string, 0, maxStuckListed+1)
	for i, t := range tasks {
		if i == maxStuckListed {
			parts = append(parts, fmt.Sprintf("and %d more", len(tasks)-i))
			break
		}
		parts = append(parts, t.String())
	}
	return fmt.Sprintf("%d not frozen: %s", len(tasks), strings.Join(parts, "; "))
}

// unfrozenTasks returns the threads of the cgroup path and its descendants
// that are not frozen.
func (m cgroupMounts) unfrozenTasks(path string) []stuckTask {
	if m.v2 {
		return unfrozenTasks("/proc", filepath.Join(m.unified, path), "cgroup.threads")
	}
	return unfrozenTasks("/proc", filepath.Join(m.v1["freezer"], path), "tasks")
}

// unfrozenTasks reads the thread ids in every listFile under dir and returns
// those that procRoot (a /proc) does not show frozen, running ones (R) first
// and those asleep in the kernel (D) last. A thread frozen on its way back to
// user space sleeps in __refrigerator (v1; state D) or do_freezer_trap (v2;
// state S); zombies and dead threads count as frozen. But since Linux 6.1 a
// thread in a freezable kernel sleep (nanosleep, a futex, a FUSE request)
// is frozen where it sleeps and shows as D in that function, exactly like a
// thread blocked there for good: the D threads returned may be frozen (see
// stillBlocked).
func unfrozenTasks(procRoot, dir, listFile string) []stuckTask {
	out := listUnfrozen(procRoot, dir, listFile)
	rank := func(t stuckTask) int {
		switch t.state {
		case "R":
			return 0
		case "D":
			return 2
		}
		return 1
	}
	slices.SortStableFunc(out, func(a, b stuckTask) int { return rank(a) - rank(b) })
	return out
}

// stillBlocked drops from tasks (read while the cgroup was freezing) the D
// threads that procRoot no longer shows in D once it was thawed: a thread
// frozen where it slept goes back to that sleep's state at the thaw (S for
// an interruptible one), while a thread blocked uninterruptibly is still D.
func stillBlocked(procRoot string, tasks []stuckTask) []stuckTask {
	return slices.DeleteFunc(tasks, func(t stuckTask) bool {
		if t.state != "D" {
			return false
		}
		now, ok := readTask(procRoot, t.pid)
		return !ok || now.state != "D"
	})
}

func listUnfrozen(procRoot, dir, listFile string) []stuckTask {
	var out []stuckTask
	seen := map[int]bool{}
	_ = filepath.WalkDir(dir, func(p string, d iofs.DirEntry, err error) error {
		if err != nil || !d.IsDir() {
			return nil
		}
		b, err := os.ReadFile(filepath.Join(p, listFile))
		if err != nil {
			return nil
		}
		for _, f := range strings.Fields(string(b)) {
			pid, err := strconv.Atoi(f)
			if err != nil || seen[pid] {
				continue
			}
			seen[pid] = true
			if t, ok := readTask(procRoot, pid); ok && !t.frozen() {
				out = append(out, t)
			}
		}
		return nil
	})
	return out
}

// readTask reads what procRoot shows of thread pid; ok is false when it is
// gone.
func readTask(procRoot string, pid int) (stuckTask, bool) {
	t := stuckTask{pid: pid}
	dir := filepath.Join(procRoot, strconv.Itoa(pid))
	b, err := os.ReadFile(filepath.Join(dir, "stat"))
	if err != nil {
		return t, false
	}
	// "pid (comm) S ...": comm may hold spaces and parentheses.
	s := string(b)
	i, j := strings.IndexByte(s, '('), strings.LastIndexByte(s, ')')
	if i < 0 || j < i {
		return t, false
	}
	t.comm = s[i+1 : j]
	if f := strings.Fields(s[j+1:]); len(f) > 0 {
		t.state = f[0]
	}
	if b, err := os.ReadFile(filepath.Join(dir, "wchan")); err == nil {
		if w := strings.TrimSpace(string(b)); w != "0" {
			t.wchan = w
		}
	}
	if b, err := os.ReadFile(filepath.Join(dir, "status")); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(line, "NSpid:"); ok {
				if f := strings.Fields(v); len(f) > 1 {
					t.nspid, _ = strconv.Atoi(f[len(f)-1])
				}
			}
		}
	}
	return t, true
}

// frozen reports whether t looks frozen (or dead).
func (t stuckTask) frozen() bool {
	switch t.state {
	case "Z", "X", "x":
		return true
	}
	return t.wchan == "__refrigerator" || t.wchan == "do_freezer_trap"
}

// readKeyed returns the value of key in a flat keyed file such as
// memory.stat ("key value" lines); ok is false when the key is absent.
func readKeyed(path, key string) (int64, bool) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, false
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, key+" "); ok {
			n, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
			return n, err == nil
		}
	}
	return 0, false
}
