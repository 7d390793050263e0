package node

import (
	"encoding/json"
	"fmt"
	"reflect"
	"testing"

	bolt "go.etcd.io/bbolt"

	"github.com/kernflux/opendsec/internal/sandboxspec"
)

// oldRecord is a table record as the node wrote it before the spec moved
// to sandboxspec (specRecord with its own struct): every spec field set.
const oldRecord = `{"id":"t001aaaaaaaaaaaaaaaa","request_id":"req-1","backend":"container",
"spec":{"backend":"container","image":"root/py:3.11","cpu":0.5,"memory_mb":256,
"timeout_seconds":600,"idle_timeout_seconds":60,"env":{"A":"1"},"user":"user",
"labels":{"team":"rl"},"task_id":"job-7","pids_limit":2048,"workdir":"/home/user",
"network":{"rule_sets":["pypi"],"allow":[{"cidr":"10.0.0.0/8","protocol":"tcp","ports":"443"},{"domain":"*.example.com"}]},
"auto_pause":true},
"state":"paused","created_at":"2026-11-30T10:00:00Z","expires_at":"2026-11-30T10:10:00Z",
"state_dir":"/var/lib/opendsec/node/sandboxes/t001aaaaaaaaaaaaaaaa",
"handle":{"ID":"t001aaaaaaaaaaaaaaaa","Version":1,"State":"e30="},
"paused_at":"2026-11-30T10:05:00Z","from_warm_pool":true}`

// A record written by the old code decodes into sandboxspec.Spec field by
// field, and encoding it again gives the same JSON (no field renamed).
func TestOldSpecRecordDecodes(t *testing.T) {
	dir := t.TempDir()
	tbl, err := openTable(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer tbl.close()
	if err := tbl.db.Update(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketSandboxes).Put([]byte("t001aaaaaaaaaaaaaaaa"), []byte(oldRecord))
	}); err != nil {
		t.Fatal(err)
	}
	recs, err := tbl.all()
	if err != nil || len(recs) != 1 {
		t.Fatalf("all: %v %v", recs, err)
	}
	want := sandboxspec.Spec{
		Backend: "container", Image: "root/py:3.11", CPU: 0.5, MemoryMB: 256,
		TimeoutSec: 600, IdleSec: 60, Env: map[string]string{"A": "1"}, User: "user",
		Labels: map[string]string{"team": "rl"}, TaskID: "job-7", PidsLimit: 2048, Workdir: "/home/user",
		Network: &sandboxspec.NetworkRules{RuleSets: []string{"pypi"}, Allow: []sandboxspec.NetworkRule{
			{CIDR: "10.0.0.0/8", Protocol: "tcp", Ports: "443"}, {Domain: "*.example.com"}}},
		AutoPause: true,
	}
	if got := recs[0].Spec; !reflect.DeepEqual(got, want) {
		t.Fatalf("decoded spec\n %+v\nwant\n %+v", got, want)
	}
	if r := recs[0]; r.State != statePaused || !r.FromPool || r.PausedAt.IsZero() || string(r.Handle.State) != "{}" {
		t.Fatalf("decoded record %+v", r)
	}
	again, err := json.Marshal(recs[0])
	if err != nil {
		t.Fatal(err)
	}
	var a, b any
	if err := json.Unmarshal([]byte(oldRecord), &a); err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(again, &b); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(a, b) {
		t.Fatalf("re-encoded record differs from the old format:\n old %s\n new %s", oldRecord, again)
	}
}

// TestTableConcurrentPutsAllLand: puts from many goroutines (which share
// commits) each return with their record stored, request ID included, and
// a reopened table has every one.
func TestTableConcurrentPutsAllLand(t *testing.T) {
	dir := t.TempDir()
	tbl, err := openTable(dir)
	if err != nil {
		t.Fatal(err)
	}
	const n = 64
	errs := make(chan error, n)
	for i := range n {
		go func() {
			id := fmt.Sprintf("t001%016d", i)
			errs <- tbl.put(&record{ID: id, RequestID: "req-" + id, State: stateCreating})
		}()
	}
	for range n {
		if err := <-errs; err != nil {
			t.Fatalf("put: %v", err)
		}
	}
	if err := tbl.close(); err != nil {
		t.Fatal(err)
	}
	if tbl, err = openTable(dir); err != nil {
		t.Fatal(err)
	}
	defer tbl.close()
	recs, err := tbl.all()
	if err != nil || len(recs) != n {
		t.Fatalf("after reopen: %d records, %v; want %d", len(recs), err, n)
	}
	reqs := 0
	if err := tbl.db.View(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketRequests).ForEach(func(k, v []byte) error {
			if string(k) == "req-"+string(v) {
				reqs++
			}
			return nil
		})
	}); err != nil || reqs != n {
		t.Fatalf("request IDs after reopen: %d, %v; want %d", reqs, err, n)
	}
}
