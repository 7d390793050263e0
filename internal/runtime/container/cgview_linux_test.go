package container

import (
	"errors"
	"os"
	"path/filepath"
	"sort"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/osthread"
	"github.com/kernflux/opendsec/internal/testutil"
)

// crun runs without the cpuset hierarchy only where cpuset has a mount
// of its own right under /sys/fs/cgroup, and never on cgroup v2.
func TestCrunCgroupViewChoice(t *testing.T) {
	hybrid := "/sys/fs/cgroup/unified"
	own := map[string]string{"cpuset": "/sys/fs/cgroup/cpuset", "memory": "/sys/fs/cgroup/memory", "name=systemd": "/sys/fs/cgroup/systemd"}
	for _, c := range []struct {
		name    string
		m       cgroupMounts
		hybrid  string
		root    string
		drop    []string
		unified string
	}{
		{"hybrid, cpuset alone", cgroupMounts{v1: own, unified: hybrid}, hybrid, "/sys/fs/cgroup", []string{"cpuset", "unified"}, hybrid},
		{"v1, cpuset alone", cgroupMounts{v1: own}, "", "/sys/fs/cgroup", []string{"cpuset"}, ""},
		{"cpuset co-mounted", cgroupMounts{v1: map[string]string{"cpuset": "/sys/fs/cgroup/cpuset,cpu", "cpu": "/sys/fs/cgroup/cpuset,cpu", "memory": "/sys/fs/cgroup/memory"}, unified: hybrid}, hybrid, "", nil, hybrid},
		{"cpuset elsewhere", cgroupMounts{v1: map[string]string{"cpuset": "/dev/cpuset", "memory": "/sys/fs/cgroup/memory"}}, "", "", nil, ""},
		{"no cpuset", cgroupMounts{v1: map[string]string{"memory": "/sys/fs/cgroup/memory"}}, "", "", nil, ""},
		{"hybrid's cgroup2 elsewhere", cgroupMounts{v1: own, unified: "/run/cgroup2"}, "/run/cgroup2", "", nil, "/run/cgroup2"},
		{"v2", cgroupMounts{v2: true, unified: "/sys/fs/cgroup"}, "", "", nil, ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			v := c.m.crunCgroupView(c.hybrid)
			var drop []string
			for d := range v.drop {
				drop = append(drop, d)
			}
			sort.Strings(drop)
			if v.root != c.root || v.unified != c.unified || len(drop) != len(c.drop) {
				t.Fatalf("view %+v, want root %q drop %v unified %q", v, c.root, c.drop, c.unified)
			}
			for i := range drop {
				if drop[i] != c.drop[i] {
					t.Fatalf("view drops %v, want %v", drop, c.drop)
				}
			}
			if v.hidesCpuset() != (c.root != "") {
				t.Fatalf("hidesCpuset %v with root %q", v.hidesCpuset(), v.root)
			}
		})
	}
}

// The view applied in a private mount namespace: every mount and symlink
// of the host's /sys/fs/cgroup but the dropped ones, each the same cgroup
// file system, on a read-only tmpfs; the host's view unchanged.
func TestCgroupViewApply(t *testing.T) {
	testutil.RequiresRoot(t)
	cg, err := detectCgroups()
	if err != nil {
		t.Fatal(err)
	}
	hybrid := ""
	if !cg.v2 {
		hybrid = cg.unified
	}
	v := cg.crunCgroupView(hybrid)
	if !v.hidesCpuset() {
		t.Skipf("this host's cpuset hierarchy is not on its own under /sys/fs/cgroup (%v)", cg.v1)
	}
	type entry struct {
		link  string
		magic int64
	}
	list := func() (map[string]entry, error) {
		ents, err := os.ReadDir(v.root)
		if err != nil {
			return nil, err
		}
		out := map[string]entry{}
		for _, e := range ents {
			p := filepath.Join(v.root, e.Name())
			if e.Type()&os.ModeSymlink != 0 {
				l, err := os.Readlink(p)
				if err != nil {
					return nil, err
				}
				out[e.Name()] = entry{link: l}
				continue
			}
			if !isMountPoint(p) {
				continue
			}
			var st unix.Statfs_t
			if err := unix.Statfs(p, &st); err != nil {
				return nil, err
			}
			out[e.Name()] = entry{magic: st.Type}
		}
		return out, nil
	}
	host, err := list()
	if err != nil {
		t.Fatal(err)
	}
	type result struct {
		got      map[string]entry
		mkdirErr error
		err      error
	}
	c := make(chan result, 1)
	osthread.Throwaway(func() {
		if err := unshareView(v); err != nil {
			c <- result{err: err}
			return
		}
		got, err := list()
		c <- result{got: got, err: err, mkdirErr: os.Mkdir(filepath.Join(v.root, "x"), 0o755)}
	})
	res := <-c
	if res.err != nil {
		t.Fatal(res.err)
	}
	for name, want := range host {
		got, ok := res.got[name]
		if v.drop[name] {
			if ok {
				t.Errorf("%s is in crun's view", name)
			}
			continue
		}
		if !ok || got != want {
			t.Errorf("%s in crun's view: %+v (present %v), want the host's %+v", name, got, ok, want)
		}
	}
	for name := range res.got {
		if _, ok := host[name]; !ok {
			t.Errorf("crun's view has %s, the host's has not", name)
		}
	}
	if !errors.Is(res.mkdirErr, unix.EROFS) {
		t.Errorf("mkdir on crun's %s: %v, want EROFS", v.root, res.mkdirErr)
	}
	after, err := list()
	if err != nil {
		t.Fatal(err)
	}
	if len(after) != len(host) {
		t.Fatalf("the host's %s changed: %v, was %v", v.root, after, host)
	}
}
