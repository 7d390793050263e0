// Package fcfake is a stand-in for Firecracker's API in tests: its
// v1.16.1 request schema (Check) and an API server with Firecracker's
// state machine and error bodies (Server). The microvm tests run it
// in-process and, as a real jailed process, through cmd fcstandin.
package fcfake

import (
	"encoding/json"
	"fmt"
	"slices"
	"sort"
	"strings"
)

// The constraints below are Firecracker's API schema for v1.16.1,
// src/firecracker/swagger/firecracker.yaml, encoded by hand (the yaml is
// not in this repository). Each schema names its definitions/<Name>. They
// were checked against the only copy of the yaml reachable here, which is
// 1.17.0-dev (commit 004d935399ba): the definitions used below are the
// same there; what that copy adds (NetworkInterface.mtu, SnapshotLoad's
// vsock_override and clock_realtime, huge_pages "Transparent") is neither
// sent nor accepted by these tables.

type field struct {
	typ      string // integer, string, boolean, object, array
	required bool
	enum     []string
	min, max int64 // integers; 0,0 = unbounded
	object   *Schema
	items    *Schema
}

type Schema struct {
	// Def is the swagger definition's name.
	Def    string
	fields map[string]field
}

var (
	// definitions/MachineConfiguration: vcpu_count 1..32 and mem_size_mib required.
	SchemaMachineConfig = &Schema{"MachineConfiguration", map[string]field{
		"vcpu_count":        {typ: "integer", required: true, min: 1, max: 32},
		"mem_size_mib":      {typ: "integer", required: true},
		"smt":               {typ: "boolean"},
		"track_dirty_pages": {typ: "boolean"},
		"huge_pages":        {typ: "string", enum: []string{"None", "2M"}},
		"cpu_template":      {typ: "string"},
	}}
	// definitions/BootSource: kernel_image_path required.
	SchemaBootSource = &Schema{"BootSource", map[string]field{
		"kernel_image_path": {typ: "string", required: true},
		"boot_args":         {typ: "string"},
		"initrd_path":       {typ: "string"},
	}}
	// definitions/Drive: drive_id and is_root_device required.
	SchemaDrive = &Schema{"Drive", map[string]field{
		"drive_id":       {typ: "string", required: true},
		"is_root_device": {typ: "boolean", required: true},
		"path_on_host":   {typ: "string"},
		"is_read_only":   {typ: "boolean"},
		"partuuid":       {typ: "string"},
		"cache_type":     {typ: "string", enum: []string{"Unsafe", "Writeback"}},
		"io_engine":      {typ: "string", enum: []string{"Sync", "Async"}},
		"socket":         {typ: "string"},
	}}
	// definitions/NetworkInterface: iface_id and host_dev_name required.
	SchemaNetworkInterface = &Schema{"NetworkInterface", map[string]field{
		"iface_id":      {typ: "string", required: true},
		"host_dev_name": {typ: "string", required: true},
		"guest_mac":     {typ: "string"},
	}}
	// definitions/Vsock: guest_cid (minimum 3) and uds_path required.
	SchemaVsock = &Schema{"Vsock", map[string]field{
		"guest_cid": {typ: "integer", required: true, min: 3, max: 1<<32 - 1},
		"uds_path":  {typ: "string", required: true},
		"vsock_id":  {typ: "string"},
	}}
	// definitions/Balloon: amount_mib and deflate_on_oom required.
	SchemaBalloon = &Schema{"Balloon", map[string]field{
		"amount_mib":               {typ: "integer", required: true},
		"deflate_on_oom":           {typ: "boolean", required: true},
		"stats_polling_interval_s": {typ: "integer"},
	}}
	// definitions/Logger: nothing required; level is an enum.
	SchemaLogger = &Schema{"Logger", map[string]field{
		"log_path":        {typ: "string"},
		"level":           {typ: "string", enum: []string{"Error", "Warning", "Info", "Debug", "Trace", "Off"}},
		"show_level":      {typ: "boolean"},
		"show_log_origin": {typ: "boolean"},
		"module":          {typ: "string"},
	}}
	// definitions/Metrics: metrics_path required.
	SchemaMetrics = &Schema{"Metrics", map[string]field{
		"metrics_path": {typ: "string", required: true},
	}}
	// definitions/InstanceActionInfo: action_type required, an enum.
	SchemaAction = &Schema{"InstanceActionInfo", map[string]field{
		"action_type": {typ: "string", required: true, enum: []string{"FlushMetrics", "InstanceStart", "SendCtrlAltDel"}},
	}}
	// definitions/Vm: state required, Paused or Resumed.
	SchemaVM = &Schema{"Vm", map[string]field{
		"state": {typ: "string", required: true, enum: []string{"Paused", "Resumed"}},
	}}
	// definitions/SnapshotCreateParams: mem_file_path and snapshot_path required.
	SchemaSnapshotCreate = &Schema{"SnapshotCreateParams", map[string]field{
		"mem_file_path": {typ: "string", required: true},
		"snapshot_path": {typ: "string", required: true},
		"snapshot_type": {typ: "string", enum: []string{"Full", "Diff"}},
	}}
	// definitions/MemoryBackend: backend_type (File, Uffd) and backend_path required.
	SchemaMemoryBackend = &Schema{"MemoryBackend", map[string]field{
		"backend_type": {typ: "string", required: true, enum: []string{"File", "Uffd"}},
		"backend_path": {typ: "string", required: true},
	}}
	// definitions/NetworkOverride: iface_id and host_dev_name required.
	SchemaNetworkOverride = &Schema{"NetworkOverride", map[string]field{
		"iface_id":      {typ: "string", required: true},
		"host_dev_name": {typ: "string", required: true},
	}}
	// definitions/SnapshotLoadParams: snapshot_path required; exactly one
	// of mem_file_path (deprecated) and mem_backend.
	SchemaSnapshotLoad = &Schema{"SnapshotLoadParams", map[string]field{
		"snapshot_path":         {typ: "string", required: true},
		"mem_file_path":         {typ: "string"},
		"mem_backend":           {typ: "object", object: SchemaMemoryBackend},
		"enable_diff_snapshots": {typ: "boolean"},
		"track_dirty_pages":     {typ: "boolean"},
		"resume_vm":             {typ: "boolean"},
		"network_overrides":     {typ: "array", items: SchemaNetworkOverride},
	}}
)

// Check validates a JSON body against s as Firecracker's deserializer
// does: unknown fields, missing required ones, wrong types, enums, ranges.
func (s *Schema) Check(body []byte) error {
	var m map[string]any
	dec := json.NewDecoder(strings.NewReader(string(body)))
	dec.UseNumber()
	if err := dec.Decode(&m); err != nil {
		return fmt.Errorf("%s: %v", s.Def, err)
	}
	return s.checkMap(m)
}

func (s *Schema) checkMap(m map[string]any) error {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		f, ok := s.fields[k]
		if !ok {
			return fmt.Errorf("%s: unknown field `%s`", s.Def, k)
		}
		if err := f.checkValue(s.Def+"."+k, m[k]); err != nil {
			return err
		}
	}
	names := make([]string, 0, len(s.fields))
	for k := range s.fields {
		names = append(names, k)
	}
	sort.Strings(names)
	for _, k := range names {
		if _, ok := m[k]; s.fields[k].required && !ok {
			return fmt.Errorf("%s: missing field `%s`", s.Def, k)
		}
	}
	if s == SchemaSnapshotLoad {
		_, a := m["mem_file_path"]
		_, b := m["mem_backend"]
		if a == b {
			return fmt.Errorf("%s: exactly one of mem_file_path and mem_backend", s.Def)
		}
	}
	return nil
}

func (f field) checkValue(name string, v any) error {
	switch f.typ {
	case "integer":
		n, ok := v.(json.Number)
		if !ok {
			return fmt.Errorf("%s: want an integer, got %T", name, v)
		}
		i, err := n.Int64()
		if err != nil {
			return fmt.Errorf("%s: want an integer, got %s", name, n)
		}
		if (f.min != 0 || f.max != 0) && (i < f.min || i > f.max) {
			return fmt.Errorf("%s: %d out of range %d..%d", name, i, f.min, f.max)
		}
	case "string":
		s, ok := v.(string)
		if !ok {
			return fmt.Errorf("%s: want a string, got %T", name, v)
		}
		if f.enum != nil && !slices.Contains(f.enum, s) {
			return fmt.Errorf("%s: %q is not one of %v", name, s, f.enum)
		}
	case "boolean":
		if _, ok := v.(bool); !ok {
			return fmt.Errorf("%s: want a boolean, got %T", name, v)
		}
	case "object":
		m, ok := v.(map[string]any)
		if !ok {
			return fmt.Errorf("%s: want an object, got %T", name, v)
		}
		return f.object.checkMap(m)
	case "array":
		a, ok := v.([]any)
		if !ok {
			return fmt.Errorf("%s: want an array, got %T", name, v)
		}
		for i, e := range a {
			m, ok := e.(map[string]any)
			if !ok {
				return fmt.Errorf("%s[%d]: want an object", name, i)
			}
			if err := f.items.checkMap(m); err != nil {
				return err
			}
		}
	}
	return nil
}
