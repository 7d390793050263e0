package cli

import (
	"encoding/json"
	"slices"
	"strings"
	"testing"

	"google.golang.org/protobuf/encoding/protojson"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/sdk/go/opendsectest"
)

func TestCreateSkipWarmPool(t *testing.T) {
	srv := opendsectest.New(t, token)
	srv.WarmPool = true

	r := mustRun(t, srv, "", "sandbox", "create", "--image", "root/busybox", "-o", "json")
	var warm opendsecv1.Sandbox
	if err := protojson.Unmarshal([]byte(r.stdout), &warm); err != nil {
		t.Fatalf("json output %q: %v", r.stdout, err)
	}
	var fields map[string]any
	if err := json.Unmarshal([]byte(r.stdout), &fields); err != nil {
		t.Fatalf("json output %q: %v", r.stdout, err)
	}
	if !warm.GetFromWarmPool() || fields["fromWarmPool"] != true {
		t.Fatalf("create without --skip-warm-pool: json %q, want fromWarmPool true", r.stdout)
	}

	r = mustRun(t, srv, "", "sandbox", "create", "--image", "root/busybox", "--skip-warm-pool", "-o", "json")
	var cold opendsecv1.Sandbox
	if err := protojson.Unmarshal([]byte(r.stdout), &cold); err != nil {
		t.Fatalf("json output %q: %v", r.stdout, err)
	}
	if cold.GetFromWarmPool() {
		t.Fatalf("create --skip-warm-pool: json %q, want fromWarmPool false", r.stdout)
	}
	if got := srv.CreateSkipWarmPool(); !slices.Equal(got, []bool{false, true}) {
		t.Fatalf("skip_warm_pool sent = %v, want [false true]", got)
	}

	r = mustRun(t, srv, "", "sandbox", "get", warm.GetId())
	if !strings.Contains(r.stdout, "From warm pool: yes") {
		t.Fatalf("get of a pooled sandbox = %q, want a From warm pool: yes line", r.stdout)
	}
	r = mustRun(t, srv, "", "sandbox", "get", cold.GetId())
	if !strings.Contains(r.stdout, "From warm pool: no") {
		t.Fatalf("get of a cold sandbox = %q, want a From warm pool: no line", r.stdout)
	}
}

func TestBatchCreateSkipWarmPool(t *testing.T) {
	srv := opendsectest.New(t, token)
	srv.WarmPool = true
	batch := func(args ...string) []*opendsecv1.Sandbox {
		t.Helper()
		r := mustRun(t, srv, "", append([]string{"sandbox", "create", "--image", "root/busybox", "--count", "3", "-o", "json"}, args...)...)
		var out opendsecv1.ListSandboxesResponse
		if err := protojson.Unmarshal([]byte(r.stdout), &out); err != nil {
			t.Fatalf("json output %q: %v", r.stdout, err)
		}
		if n := len(out.GetSandboxes()); n != 3 {
			t.Fatalf("json output %q: %d sandboxes, want 3", r.stdout, n)
		}
		return out.GetSandboxes()
	}

	for _, sb := range batch() {
		if !sb.GetFromWarmPool() {
			t.Errorf("create --count 3: sandbox %s fromWarmPool false, want true", sb.GetId())
		}
	}
	for _, sb := range batch("--skip-warm-pool") {
		if sb.GetFromWarmPool() {
			t.Errorf("create --count 3 --skip-warm-pool: sandbox %s fromWarmPool true, want false", sb.GetId())
		}
	}
	if got := srv.BatchSkipWarmPool(); !slices.Equal(got, []bool{false, true}) {
		t.Fatalf("skip_warm_pool sent with the batches = %v, want [false true]", got)
	}
	if got := srv.CreateSkipWarmPool(); len(got) != 0 {
		t.Fatalf("single creates sent = %v, want none (--count 3 is one batch)", got)
	}
}

func TestPrewarm(t *testing.T) {
	srv := opendsectest.New(t, token)
	srv.PoolRoom = 5
	r := mustRun(t, srv, "", "sandbox", "prewarm", "--image", "root/busybox", "--cpu", "0.1", "--memory-mb", "128", "--count", "3", "--ttl", "2m", "--wait")
	if r.stdout != "held 3 of 3 (3 ready) for 120s\n" {
		t.Fatalf("prewarm 3: %q", r.stdout)
	}
	r = mustRun(t, srv, "", "sandbox", "prewarm", "--image", "root/busybox", "-n", "9")
	if !strings.HasPrefix(r.stdout, "held 5 of 9 (5 ready) for 600s\nfewer: capacity:") {
		t.Fatalf("prewarm 9 with room for 5: %q", r.stdout)
	}
	got := srv.Prewarms()
	if len(got) != 2 || got[0].GetCount() != 3 || got[0].GetTtlSeconds() != 120 || !got[0].GetWait() ||
		got[0].GetSpec().GetCpu() != 0.1 || got[0].GetSpec().GetMemoryMb() != 128 || got[1].GetSpec().MemoryMb != nil {
		t.Fatalf("server got %v", got)
	}
	for _, args := range [][]string{
		{"--image", "root/busybox"},
		{"--image", "root/busybox", "--count", "0"},
		{"--count", "3"},
		{"--image", "root/busybox", "--count", "3", "--ttl", "soon"},
	} {
		if r := run(t, srv, "", append([]string{"sandbox", "prewarm"}, args...)...); r.code == 0 {
			t.Errorf("prewarm %v: exit 0", args)
		}
	}
	if len(srv.Prewarms()) != 2 {
		t.Fatal("a refused prewarm reached the server")
	}
}
