package fcfake

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"sync"
)

// InstanceInfo is GET /'s answer (definitions/InstanceInfo).
type InstanceInfo struct {
	AppName    string `json:"app_name"`
	ID         string `json:"id"`
	State      string `json:"state"`
	VMMVersion string `json:"vmm_version"`
}

// VMState is what the fake writes as a snapshot's state file and reads
// back at a load: what a loaded VMM needs to behave as its source did.
type VMState struct {
	VCPUs    int    `json:"vcpus"`
	MemMiB   int64  `json:"mem_mib"`
	VsockUDS string `json:"vsock_uds,omitempty"`
	Tap      string `json:"tap,omitempty"`
	// MemFile is the memory file a load maps (not written in snapshots).
	MemFile string `json:"-"`
}

// Server is Firecracker's API with its state machine: configure before
// InstanceStart, pause and resume after it, snapshot create when paused,
// load only into a fresh VMM. Every body is checked against the schema;
// errors are 400 with {"fault_message": ...} as Firecracker answers them.
// Paths in bodies are opened as given (inside a jail they are the jail's).
type Server struct {
	// ID is GET /'s id (Firecracker's --id).
	ID string
	// OnStart runs at a successful InstanceStart or a load with
	// resume_vm, with the VM's state; an error is the call's 400.
	OnStart func(st VMState) error
	// OnStartFailed runs after a failed InstanceStart was answered
	// (Firecracker exits then).
	OnStartFailed func()
	// OnCtrlAltDel runs after SendCtrlAltDel was answered (the guest
	// powers off, Firecracker exits).
	OnCtrlAltDel func()
	// OnSnapshot runs after a snapshot's files were written.
	OnSnapshot func(statePath, memPath string)

	mu         sync.Mutex
	calls      []string // "PUT /machine-config", in order
	bodies     map[string][]byte
	state      string // "Not started", "Running", "Paused"
	configured bool
	loaded     bool
	kernel     bool
	vm         VMState
	// failOn answers this "METHOD /path" with failMsg.
	failOn, failMsg string
}

// NewServer returns a fresh VMM's API (state "Not started").
func NewServer(id string) *Server {
	return &Server{ID: id, state: "Not started", vm: VMState{MemMiB: 128, VCPUs: 1}, bodies: map[string][]byte{}}
}

// Calls are the requests so far, "METHOD /path", in order.
func (f *Server) Calls() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.calls...)
}

// Body is the last body of call ("PUT /drives/rw").
func (f *Server) Body(call string) []byte {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.bodies[call]
}

// FailNext makes every later call ("METHOD /path") fail with msg.
func (f *Server) FailNext(call, msg string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.failOn, f.failMsg = call, msg
}

// State is the VM's state as GET / says it.
func (f *Server) State() string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.state
}

// Fault writes Firecracker's error body.
func Fault(w http.ResponseWriter, status int, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(map[string]string{"fault_message": msg})
}

var preBoot = map[string]bool{"PUT /machine-config": true, "PUT /boot-source": true, "PUT /drives": true,
	"PUT /network-interfaces": true, "PUT /vsock": true, "PUT /balloon": true, "PUT /logger": true, "PUT /metrics": true}

// ServeHTTP implements http.Handler.
func (f *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	after := func() {}
	f.mu.Lock()
	defer func() {
		f.mu.Unlock()
		after()
	}()
	body, _ := io.ReadAll(r.Body)
	call := r.Method + " " + r.URL.Path
	f.calls = append(f.calls, call)
	f.bodies[call] = body
	if call == f.failOn {
		Fault(w, http.StatusBadRequest, f.failMsg)
		return
	}
	route, id, _ := strings.Cut(strings.TrimPrefix(r.URL.Path, "/"), "/")
	key := r.Method + " /" + route
	schemas := map[string]*Schema{
		"PUT /machine-config": SchemaMachineConfig, "PUT /boot-source": SchemaBootSource,
		"PUT /drives": SchemaDrive, "PUT /network-interfaces": SchemaNetworkInterface,
		"PUT /vsock": SchemaVsock, "PUT /balloon": SchemaBalloon, "PUT /logger": SchemaLogger,
		"PUT /metrics": SchemaMetrics, "PUT /actions": SchemaAction, "PATCH /vm": SchemaVM,
		"PUT /snapshot": nil, "GET /": nil, "GET /machine-config": nil,
	}
	if route == "snapshot" {
		switch id {
		case "create":
			schemas[key] = SchemaSnapshotCreate
		case "load":
			schemas[key] = SchemaSnapshotLoad
		}
	}
	s, known := schemas[key]
	if !known || (key == "PUT /snapshot" && s == nil) {
		Fault(w, http.StatusBadRequest, "Invalid request method and/or path: "+r.Method+" "+r.URL.Path+".")
		return
	}
	var m map[string]any
	if s != nil {
		if err := s.Check(body); err != nil {
			Fault(w, http.StatusBadRequest, "An error occurred when deserializing the json body of a request: "+err.Error()+".")
			return
		}
		_ = json.Unmarshal(body, &m)
	}
	if preBoot[key] {
		if f.state != "Not started" || f.loaded {
			Fault(w, http.StatusBadRequest, "The requested operation is not supported after starting the microVM.")
			return
		}
		f.configured = true
	}
	str := func(k string) string { v, _ := m[k].(string); return v }
	switch key {
	case "GET /":
		_ = json.NewEncoder(w).Encode(InstanceInfo{AppName: "Firecracker", ID: f.ID, State: f.state, VMMVersion: "1.16.1"})
		return
	case "GET /machine-config":
		_ = json.NewEncoder(w).Encode(map[string]any{"vcpu_count": f.vm.VCPUs, "mem_size_mib": f.vm.MemMiB})
		return
	case "PUT /machine-config":
		mem, _ := m["mem_size_mib"].(float64)
		if mem <= 0 {
			Fault(w, http.StatusBadRequest, "The memory size (MiB) is either 0, or not a multiple of the configured page size.")
			return
		}
		f.vm.MemMiB = int64(mem)
		v, _ := m["vcpu_count"].(float64)
		f.vm.VCPUs = int(v)
	case "PUT /boot-source":
		if _, err := os.Stat(str("kernel_image_path")); err != nil {
			Fault(w, http.StatusBadRequest, "The kernel file cannot be opened: No such file or directory (os error 2)")
			return
		}
		f.kernel = true
	case "PUT /drives":
		if str("drive_id") != id {
			Fault(w, http.StatusBadRequest, "The id from the path does not match the id from the body!")
			return
		}
		flag := os.O_RDWR
		if ro, _ := m["is_read_only"].(bool); ro {
			flag = os.O_RDONLY
		}
		df, err := os.OpenFile(str("path_on_host"), flag, 0)
		if err != nil {
			Fault(w, http.StatusBadRequest, fmt.Sprintf("Unable to create the block device: BackingFile(%v)", err))
			return
		}
		_ = df.Close()
	case "PUT /network-interfaces":
		if str("iface_id") != id {
			Fault(w, http.StatusBadRequest, "The id from the path does not match the id from the body!")
			return
		}
		f.vm.Tap = str("host_dev_name")
	case "PUT /vsock":
		f.vm.VsockUDS = str("uds_path")
	case "PUT /actions":
		switch str("action_type") {
		case "InstanceStart":
			if f.state != "Not started" {
				Fault(w, http.StatusBadRequest, "The requested operation is not supported after starting the microVM.")
				return
			}
			if !f.kernel {
				Fault(w, http.StatusBadRequest, "Cannot start microvm without kernel configuration.")
				if f.OnStartFailed != nil {
					after = f.OnStartFailed
				}
				return
			}
			if f.OnStart != nil {
				if err := f.OnStart(f.vm); err != nil {
					Fault(w, http.StatusBadRequest, "Failed to start microVM: "+err.Error())
					if f.OnStartFailed != nil {
						after = f.OnStartFailed
					}
					return
				}
			}
			f.state = "Running"
		case "SendCtrlAltDel":
			if f.state == "Not started" {
				Fault(w, http.StatusBadRequest, "The requested operation is not supported before starting the microVM.")
				return
			}
			if f.OnCtrlAltDel != nil {
				after = f.OnCtrlAltDel
			}
		}
	case "PATCH /vm":
		if f.state == "Not started" {
			Fault(w, http.StatusBadRequest, "The requested operation is not supported before starting the microVM.")
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
				Fault(w, http.StatusBadRequest, "Create snapshot error: Cannot save the microVM state: microVM is not paused.")
				return
			}
			b, _ := json.Marshal(f.vm)
			if err := os.WriteFile(str("snapshot_path"), b, 0o600); err != nil {
				Fault(w, http.StatusBadRequest, "Create snapshot error: "+err.Error())
				return
			}
			mf, err := os.OpenFile(str("mem_file_path"), os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o600)
			if err == nil {
				_, err = mf.WriteString("guest memory")
				err = errors.Join(err, mf.Truncate(f.vm.MemMiB<<20), mf.Close())
			}
			if err != nil {
				Fault(w, http.StatusBadRequest, "Create snapshot error: "+err.Error())
				return
			}
			if f.OnSnapshot != nil {
				f.OnSnapshot(str("snapshot_path"), str("mem_file_path"))
			}
			break
		}
		if f.configured || f.state != "Not started" || f.loaded {
			Fault(w, http.StatusBadRequest, "Loading a microVM snapshot not allowed after configuring boot-specific resources.")
			return
		}
		mb, _ := m["mem_backend"].(map[string]any)
		b, err := os.ReadFile(str("snapshot_path"))
		if err == nil {
			_, err = os.Stat(fmt.Sprint(mb["backend_path"]))
		}
		var st VMState
		if err == nil {
			err = json.Unmarshal(b, &st)
		}
		if err != nil {
			Fault(w, http.StatusBadRequest, "Load snapshot error: Failed to restore from snapshot: "+err.Error())
			return
		}
		if ov, _ := m["network_overrides"].([]any); len(ov) > 0 {
			o, _ := ov[0].(map[string]any)
			st.Tap, _ = o["host_dev_name"].(string)
		}
		if bt, _ := mb["backend_type"].(string); bt == "File" {
			st.MemFile, _ = mb["backend_path"].(string)
		}
		f.vm = st
		f.loaded = true
		f.state = "Paused"
		if r, _ := m["resume_vm"].(bool); r {
			if f.OnStart != nil {
				if err := f.OnStart(f.vm); err != nil {
					Fault(w, http.StatusBadRequest, "Load snapshot error: "+err.Error())
					return
				}
			}
			f.state = "Running"
		}
	}
	w.WriteHeader(http.StatusNoContent)
}
