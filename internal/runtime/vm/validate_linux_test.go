package vm

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	goruntime "runtime"
	"strings"
	"testing"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
)

// Bad specs are refused with the field named, and nothing is made.
func TestCreateRefusesBadSpecs(t *testing.T) {
	r, assets := newTestRuntime(t)
	cases := []struct {
		name string
		res  runtime.Resources
		prep func()
		want string
	}{
		{"0 MiB memory", runtime.Resources{CPU: 1, MemoryMB: 0}, nil, "resources.memory_mb"},
		{"1 MiB memory", runtime.Resources{CPU: 1, MemoryMB: 1}, nil, "resources.memory_mb"},
		{"no cpu", runtime.Resources{MemoryMB: 64}, nil, "resources.cpu"},
		{"too many vcpus", runtime.Resources{CPU: float64(goruntime.NumCPU() + 1), MemoryMB: 64}, nil, "resources.cpu"},
		{"missing kernel", haltRes(16), func() { _ = os.Remove(filepath.Join(assets, "vmlinux")) }, "vmlinux"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if c.prep != nil {
				c.prep()
			}
			sd := t.TempDir()
			_, err := r.Create(context.Background(), runtime.Spec{ID: "bad", StateDir: sd, Rootfs: haltRootfs(), Resources: c.res})
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("error %v, want one naming %s", err, c.want)
			}
			if !errors.Is(err, errdefs.ErrInvalidArgument) && !errors.Is(err, errdefs.ErrFailedPrecondition) {
				t.Fatalf("error %v has no errdefs category", err)
			}
			if ents, _ := os.ReadDir(sd); len(ents) != 0 {
				t.Fatalf("left in the state dir: %v", ents)
			}
			if _, err := r.Status(context.Background(), "bad"); !errors.Is(err, errdefs.ErrNotFound) {
				t.Fatalf("sandbox known after a failed create: %v", err)
			}
		})
	}
}

func TestConfigRefusesBadValues(t *testing.T) {
	for _, c := range []Config{{Accel: "hvf"}, {Machine: "pc"}, {VCPUs: -1}} {
		if _, err := New(context.Background(), c); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("config %+v: error %v, want invalid argument", c, err)
		}
	}
}
