package container

import (
	"strings"
	"testing"

	"github.com/kernflux/opendsec/internal/runtime/runtimetest"
)

// TestAgentShieldedFromOOMKiller checks the processes the agent starts are
// the OOM killer's preferred victims, not the agent (PID 1).
func TestAgentShieldedFromOOMKiller(t *testing.T) {
	f := newFactory(t)
	rt, tmpl := f(t)
	spec, _ := runtimetest.StartSandbox(t, rt, tmpl)
	res := sh(t, rt, spec.ID, `cat /proc/1/oom_score_adj; cat /proc/self/oom_score_adj`)
	got := strings.Fields(res.Stdout)
	if len(got) != 2 || (got[0] != "0" && got[0] != "-1000") {
		t.Fatalf("oom_score_adj of agent and child: %q, want the agent at 0 (or -1000 where it may lower it)", got)
	}
	if got[1] != "500" {
		t.Fatalf("oom_score_adj of a process the agent started: %s, want 500 (preferred OOM victim over the agent's %s)", got[1], got[0])
	}
}
