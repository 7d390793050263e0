package container

import (
	"slices"
	"testing"

	"github.com/kernflux/opendsec/internal/runtime/runtimetest"
)

// TestInitGOMAXPROCSIsInitsAlone: init (PID 1) runs with GOMAXPROCS=1
// first in its environment (initOwnEnv), and neither the agent nor a
// process it starts gets it; a GOMAXPROCS of the sandbox's own env does.
func TestInitGOMAXPROCSIsInitsAlone(t *testing.T) {
	f := newFactory(t)
	rt, tmpl := f(t)
	tmpl.Guest.Env = append(tmpl.Guest.Env, "OPENDSEC_TEST_MARK=x")
	spec, _ := runtimetest.StartSandbox(t, rt, tmpl)
	res := sh(t, rt, spec.ID, `tr '\0' '\n' < /proc/1/environ | head -n 1; echo "[${GOMAXPROCS-unset}] [$OPENDSEC_TEST_MARK]"`)
	if res.Stdout != "GOMAXPROCS=1\n[unset] [x]\n" {
		t.Fatalf("init's first env entry, then a process's GOMAXPROCS and guest mark: %q (stderr %q), want GOMAXPROCS=1, unset, x", res.Stdout, res.Stderr)
	}

	tmpl.Guest.Env = append(slices.Clone(tmpl.Guest.Env), "GOMAXPROCS=3")
	spec, _ = runtimetest.StartSandbox(t, rt, tmpl)
	res = sh(t, rt, spec.ID, `echo "[${GOMAXPROCS-unset}]"`)
	if res.Stdout != "[3]\n" {
		t.Fatalf("a process's GOMAXPROCS with the sandbox's GOMAXPROCS=3: %q (stderr %q)", res.Stdout, res.Stderr)
	}
}
