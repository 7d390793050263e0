package microvm

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
)

// fakeFC is a Firecracker API server on a unix socket for tests: it
// validates bodies against the v1.16.1 schema (schema_test.go), keeps the
// VM state machine (configure, start, pause, snapshot, load) and answers
// errors the way Firecracker does, 400 with {"fault_message": ...}.
type fakeFC struct {
	t    *testing.T
	sock string

	mu         sync.Mutex
	calls      []string // "PUT /machine-config", in order
	bodies     map[string][]byte
	state      string // "Not started", "Running", "Paused"
	configured bool
	loaded     bool
	kernel     bool
	memMiB     int64
	vcpus      int
	// failOn answers this "METHOD /path" with failMsg.
	failOn, failMsg string
}

func newFakeFC(t *testing.T) *fakeFC {
	t.Helper()
	dir, err := os.MkdirTemp("", "fc") // short: sun_path is 108 bytes
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	f := &fakeFC{t: t, sock: filepath.Join(dir, "api.sock"), state: "Not started", memMiB: 128, vcpus: 1, bodies: map[string][]byte{}}
	ln, err := net.Listen("unix", f.sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: f}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close() })
	return f
}

func (f *fakeFC) client() *Client { return NewClient(f.sock) }

func (f *fakeFC) Calls() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.calls...)
}

func (f *fakeFC) body(call string) []byte {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.bodies[call]
}

func fault(w http.ResponseWriter, status int, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(apiError{FaultMessage: msg})
}

func (f *fakeFC) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	f.mu.Lock()
	defer f.mu.Unlock()
	body, _ := io.ReadAll(r.Body)
	call := r.Method + " " + r.URL.Path
	f.calls = append(f.calls, call)
	f.bodies[call] = body
	if call == f.failOn {
		fault(w, http.StatusBadRequest, f.failMsg)
		return
	}
	route, id, _ := strings.Cut(strings.TrimPrefix(r.URL.Path, "/"), "/")
	key := r.Method + " /" + route
	schemas := map[string]*schema{
		"PUT /machine-config": schemaMachineConfig, "PUT /boot-source": schemaBootSource,
		"PUT /drives": schemaDrive, "PUT /network-interfaces": schemaNetworkInterface,
		"PUT /vsock": schemaVsock, "PUT /balloon": schemaBalloon, "PUT /logger": schemaLogger,
		"PUT /metrics": schemaMetrics, "PUT /actions": schemaAction, "PATCH /vm": schemaVM,
		"PUT /snapshot": nil, "GET /": nil, "GET /machine-config": nil,
	}
	if route == "snapshot" {
		switch id {
		case "create":
			schemas[key] = schemaSnapshotCreate
		case "load":
			schemas[key] = schemaSnapshotLoad
		}
	}
	s, known := schemas[key]
	if !known || (key == "PUT /snapshot" && s == nil) {
		fault(w, http.StatusBadRequest, "Invalid request method and/or path: "+r.Method+" "+r.URL.Path+".")
		return
	}
	var m map[string]any
	if s != nil {
		if err := s.check(body); err != nil {
			fault(w, http.StatusBadRequest, "An error occurred when deserializing the json body of a request: "+err.Error()+".")
			return
		}
		_ = json.Unmarshal(body, &m)
	}
	preBoot := map[string]bool{"PUT /machine-config": true, "PUT /boot-source": true, "PUT /drives": true,
		"PUT /network-interfaces": true, "PUT /vsock": true, "PUT /balloon": true, "PUT /logger": true, "PUT /metrics": true}
	if preBoot[key] {
		if f.state != "Not started" || f.loaded {
			fault(w, http.StatusBadRequest, "The requested operation is not supported after starting the microVM.")
			return
		}
		f.configured = true
	}
	str := func(k string) string { v, _ := m[k].(string); return v }
	switch key {
	case "GET /":
		_ = json.NewEncoder(w).Encode(InstanceInfo{AppName: "Firecracker", ID: "anonymous-instance", State: f.state, VMMVersion: "1.16.1"})
		return
	case "GET /machine-config":
		_ = json.NewEncoder(w).Encode(MachineConfig{VcpuCount: f.vcpus, MemSizeMib: f.memMiB})
		return
	case "PUT /machine-config":
		mem, _ := m["mem_size_mib"].(float64)
		if mem <= 0 {
			fault(w, http.StatusBadRequest, "The memory size (MiB) is either 0, or not a multiple of the configured page size.")
			return
		}
		f.memMiB = int64(mem)
		v, _ := m["vcpu_count"].(float64)
		f.vcpus = int(v)
	case "PUT /boot-source":
		if _, err := os.Stat(str("kernel_image_path")); err != nil {
			fault(w, http.StatusBadRequest, "The kernel file cannot be opened: No such file or directory (os error 2)")
			return
		}
		f.kernel = true
	case "PUT /drives":
		if str("drive_id") != id {
			fault(w, http.StatusBadRequest, "The id from the path does not match the id from the body!")
			return
		}
		if _, err := os.Stat(str("path_on_host")); err != nil {
			fault(w, http.StatusBadRequest, "Unable to create the block device: BackingFile(Os { code: 2, kind: NotFound, message: \"No such file or directory\" })")
			return
		}
	case "PUT /network-interfaces":
		if str("iface_id") != id {
			fault(w, http.StatusBadRequest, "The id from the path does not match the id from the body!")
			return
		}
	case "PUT /actions":
		switch str("action_type") {
		case "InstanceStart":
			if f.state != "Not started" {
				fault(w, http.StatusBadRequest, "The requested operation is not supported after starting the microVM.")
				return
			}
			if !f.kernel {
				fault(w, http.StatusBadRequest, "Cannot start microvm without kernel configuration.")
				return
			}
			f.state = "Running"
		case "SendCtrlAltDel":
			if f.state == "Not started" {
				fault(w, http.StatusBadRequest, "The requested operation is not supported before starting the microVM.")
				return
			}
		}
	case "PATCH /vm":
		if f.state == "Not started" {
			fault(w, http.StatusBadRequest, "The requested operation is not supported before starting the microVM.")
			return
		}
		if str("state") == "Paused" {
			f.state = "Paused"
		} else {
			f.state = "Running"
		}
	case "PUT /snapshot":
		if id == "create" {
			if f.state != "Paused" {
				fault(w, http.StatusBadRequest, "Create snapshot error: Cannot save the microVM state: microVM is not paused.")
				return
			}
			if err := os.WriteFile(str("snapshot_path"), []byte("vmstate of a "+fmt.Sprint(f.vcpus)+" vcpu vm"), 0o600); err != nil {
				fault(w, http.StatusBadRequest, "Create snapshot error: "+err.Error())
				return
			}
			mf, err := os.Create(str("mem_file_path"))
			if err == nil {
				err = errors.Join(mf.Truncate(f.memMiB<<20), mf.Close())
			}
			if err != nil {
				fault(w, http.StatusBadRequest, "Create snapshot error: "+err.Error())
				return
			}
			break
		}
		if f.configured || f.state != "Not started" || f.loaded {
			fault(w, http.StatusBadRequest, "Loading a microVM snapshot not allowed after configuring boot-specific resources.")
			return
		}
		mb, _ := m["mem_backend"].(map[string]any)
		for _, p := range []string{str("snapshot_path"), fmt.Sprint(mb["backend_path"])} {
			if _, err := os.Stat(p); err != nil {
				fault(w, http.StatusBadRequest, "Load snapshot error: Failed to restore from snapshot: "+err.Error())
				return
			}
		}
		f.loaded = true
		f.state = "Paused"
		if r, _ := m["resume_vm"].(bool); r {
			f.state = "Running"
		}
	}
	w.WriteHeader(http.StatusNoContent)
}
