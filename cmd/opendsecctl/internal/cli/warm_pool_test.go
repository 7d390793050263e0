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

func TestCreateSkipWarmPoolWithCountIsRefused(t *testing.T) {
	srv := opendsectest.New(t, token)
	r := run(t, srv, "", "sandbox", "create", "--image", "root/busybox", "--count", "2", "--skip-warm-pool")
	if r.code != 1 || !strings.Contains(r.stderr, "--skip-warm-pool:") || r.stdout != "" {
		t.Fatalf("exit %d, stdout %q, stderr %q; want exit 1 naming --skip-warm-pool", r.code, r.stdout, r.stderr)
	}
	if n := len(srv.Sandboxes()); n != 0 {
		t.Fatalf("refused create made %d sandboxes", n)
	}
}
