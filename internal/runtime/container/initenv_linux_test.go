package container

import (
	"slices"
	"testing"

	"github.com/kernflux/opendsec/internal/runtime/runtimetest"
)

// TestInitEnvIsTheSandboxs: init (PID 1) runs with the sandbox's
// environment and nothing of its own (the Go init had GOMAXPROCS=1 first),
// and a process sees the same; a GOMAXPROCS of the sandbox's own env
// reaches processes.
func TestInitEnvIsTheSandboxs(t *testing.T) {
	f := newFactory(t)
	rt, tmpl := f(t)
	tmpl.Guest.Env = append(tmpl.Guest.Env, "OPENDSEC_TEST_MARK=x")
	spec, _ := runtimetest.StartSandbox(t, rt, tmpl)
	res := sh(t, rt, spec.ID, `tr '\0' '\n' < /proc/1/environ | grep -c -e '^GOMAXPROCS=' -e '^OPENDSEC_TEST_MARK=x$'; echo "[${GOMAXPROCS-unset}] [$OPENDSEC_TEST_MARK]"`)
	if res.Stdout != "1\n[unset] [x]\n" {
		t.Fatalf("init's GOMAXPROCS and mark entries, then a process's GOMAXPROCS and mark: %q (stderr %q), want 1 (the mark alone), unset, x", res.Stdout, res.Stderr)
	}

	tmpl.Guest.Env = append(slices.Clone(tmpl.Guest.Env), "GOMAXPROCS=3")
	spec, _ = runtimetest.StartSandbox(t, rt, tmpl)
	res = sh(t, rt, spec.ID, `echo "[${GOMAXPROCS-unset}]"`)
	if res.Stdout != "[3]\n" {
		t.Fatalf("a process's GOMAXPROCS with the sandbox's GOMAXPROCS=3: %q (stderr %q)", res.Stdout, res.Stderr)
	}
}
