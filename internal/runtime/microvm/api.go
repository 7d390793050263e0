// Package microvm is the Firecracker backend: one jailed firecracker
// process per sandbox, driven through its API socket (raw HTTP over a unix
// socket; see docs/ARCHITECTURE.md for why not firecracker-go-sdk).
//
// The request types follow Firecracker v1.16.1's API
// (src/firecracker/swagger/firecracker.yaml); the tests check each one
// against the schema's required fields, types and enums.
package microvm

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"time"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/vmchan"
)

// MachineConfig is PUT /machine-config (definitions/MachineConfiguration).
type MachineConfig struct {
	VcpuCount       int    `json:"vcpu_count"`
	MemSizeMib      int64  `json:"mem_size_mib"`
	Smt             bool   `json:"smt,omitempty"`
	TrackDirtyPages bool   `json:"track_dirty_pages,omitempty"`
	HugePages       string `json:"huge_pages,omitempty"` // "None" or "2M"
}

// BootSource is PUT /boot-source (definitions/BootSource).
type BootSource struct {
	KernelImagePath string `json:"kernel_image_path"`
	BootArgs        string `json:"boot_args,omitempty"`
	InitrdPath      string `json:"initrd_path,omitempty"`
}

// Drive is PUT /drives/{drive_id} (definitions/Drive).
type Drive struct {
	DriveID      string `json:"drive_id"`
	PathOnHost   string `json:"path_on_host"`
	IsRootDevice bool   `json:"is_root_device"`
	IsReadOnly   bool   `json:"is_read_only"`
	CacheType    string `json:"cache_type,omitempty"` // "Unsafe" or "Writeback"
	IOEngine     string `json:"io_engine,omitempty"`  // "Sync" or "Async"
}

// NetworkInterface is PUT /network-interfaces/{iface_id}
// (definitions/NetworkInterface).
type NetworkInterface struct {
	IfaceID     string `json:"iface_id"`
	HostDevName string `json:"host_dev_name"`
	GuestMAC    string `json:"guest_mac,omitempty"`
}

// Vsock is PUT /vsock (definitions/Vsock).
type Vsock struct {
	GuestCID uint32 `json:"guest_cid"`
	UDSPath  string `json:"uds_path"`
}

// Balloon is PUT /balloon (definitions/Balloon).
type Balloon struct {
	AmountMib             int64 `json:"amount_mib"`
	DeflateOnOOM          bool  `json:"deflate_on_oom"`
	StatsPollingIntervalS int   `json:"stats_polling_interval_s,omitempty"`
}

// Logger is PUT /logger (definitions/Logger).
type Logger struct {
	LogPath       string `json:"log_path,omitempty"`
	Level         string `json:"level,omitempty"` // Error, Warning, Info, Debug, Trace, Off
	ShowLevel     bool   `json:"show_level,omitempty"`
	ShowLogOrigin bool   `json:"show_log_origin,omitempty"`
}

// Metrics is PUT /metrics (definitions/Metrics).
type Metrics struct {
	MetricsPath string `json:"metrics_path"`
}

// Action types of PUT /actions (definitions/InstanceActionInfo).
const (
	ActionInstanceStart  = "InstanceStart"
	ActionSendCtrlAltDel = "SendCtrlAltDel"
)

// InstanceAction is PUT /actions.
type InstanceAction struct {
	ActionType string `json:"action_type"`
}

// VM states of PATCH /vm (definitions/Vm).
const (
	VMPaused  = "Paused"
	VMResumed = "Resumed"
)

// VM is PATCH /vm.
type VM struct {
	State string `json:"state"`
}

// Snapshot types of PUT /snapshot/create.
const (
	SnapshotFull = "Full"
	SnapshotDiff = "Diff"
)

// SnapshotCreate is PUT /snapshot/create (definitions/SnapshotCreateParams).
type SnapshotCreate struct {
	SnapshotType string `json:"snapshot_type,omitempty"`
	SnapshotPath string `json:"snapshot_path"`
	MemFilePath  string `json:"mem_file_path"`
}

// MemoryBackend is SnapshotLoad's mem_backend (definitions/MemoryBackend).
// With "File" Firecracker maps the file MAP_PRIVATE, so clones loaded from
// one memory file share its pages until they write them.
type MemoryBackend struct {
	BackendType string `json:"backend_type"` // "File" or "Uffd"
	BackendPath string `json:"backend_path"`
}

// NetworkOverride is one entry of SnapshotLoad's network_overrides
// (definitions/NetworkOverride): the clone's own tap for an interface.
type NetworkOverride struct {
	IfaceID     string `json:"iface_id"`
	HostDevName string `json:"host_dev_name"`
}

// SnapshotLoad is PUT /snapshot/load (definitions/SnapshotLoadParams).
type SnapshotLoad struct {
	SnapshotPath     string            `json:"snapshot_path"`
	MemBackend       *MemoryBackend    `json:"mem_backend,omitempty"`
	TrackDirtyPages  bool              `json:"track_dirty_pages,omitempty"`
	ResumeVM         bool              `json:"resume_vm,omitempty"`
	NetworkOverrides []NetworkOverride `json:"network_overrides,omitempty"`
}

// InstanceInfo is GET / (definitions/InstanceInfo).
type InstanceInfo struct {
	AppName    string `json:"app_name"`
	ID         string `json:"id"`
	State      string `json:"state"` // "Not started", "Running", "Paused"
	VMMVersion string `json:"vmm_version"`
}

// apiError is Firecracker's error body (definitions/Error).
type apiError struct {
	FaultMessage string `json:"fault_message"`
}

// Client talks to one Firecracker API socket.
type Client struct {
	sock string
	hc   *http.Client
}

// NewClient returns a client of the API socket at sock.
func NewClient(sock string) *Client {
	tr := &http.Transport{
		// A jail's socket path can be longer than sun_path.
		DialContext:       func(ctx context.Context, _, _ string) (net.Conn, error) { return vmchan.DialUnix(ctx, sock) },
		DisableKeepAlives: true,
	}
	return &Client{sock: sock, hc: &http.Client{Transport: tr, Timeout: 30 * time.Second}}
}

// PutMachineConfig is PUT /machine-config.
func (c *Client) PutMachineConfig(ctx context.Context, m MachineConfig) error {
	return c.do(ctx, http.MethodPut, "/machine-config", m, nil)
}

// GetMachineConfig is GET /machine-config.
func (c *Client) GetMachineConfig(ctx context.Context) (MachineConfig, error) {
	var m MachineConfig
	err := c.do(ctx, http.MethodGet, "/machine-config", nil, &m)
	return m, err
}

// PutBootSource is PUT /boot-source.
func (c *Client) PutBootSource(ctx context.Context, b BootSource) error {
	return c.do(ctx, http.MethodPut, "/boot-source", b, nil)
}

// PutDrive is PUT /drives/{drive_id}.
func (c *Client) PutDrive(ctx context.Context, d Drive) error {
	return c.do(ctx, http.MethodPut, "/drives/"+d.DriveID, d, nil)
}

// PutNetworkInterface is PUT /network-interfaces/{iface_id}.
func (c *Client) PutNetworkInterface(ctx context.Context, n NetworkInterface) error {
	return c.do(ctx, http.MethodPut, "/network-interfaces/"+n.IfaceID, n, nil)
}

// PutVsock is PUT /vsock.
func (c *Client) PutVsock(ctx context.Context, v Vsock) error {
	return c.do(ctx, http.MethodPut, "/vsock", v, nil)
}

// PutBalloon is PUT /balloon.
func (c *Client) PutBalloon(ctx context.Context, b Balloon) error {
	return c.do(ctx, http.MethodPut, "/balloon", b, nil)
}

// PutLogger is PUT /logger.
func (c *Client) PutLogger(ctx context.Context, l Logger) error {
	return c.do(ctx, http.MethodPut, "/logger", l, nil)
}

// PutMetrics is PUT /metrics.
func (c *Client) PutMetrics(ctx context.Context, m Metrics) error {
	return c.do(ctx, http.MethodPut, "/metrics", m, nil)
}

// Action is PUT /actions.
func (c *Client) Action(ctx context.Context, actionType string) error {
	return c.do(ctx, http.MethodPut, "/actions", InstanceAction{ActionType: actionType}, nil)
}

// PatchVM is PATCH /vm (VMPaused or VMResumed).
func (c *Client) PatchVM(ctx context.Context, state string) error {
	return c.do(ctx, http.MethodPatch, "/vm", VM{State: state}, nil)
}

// CreateSnapshot is PUT /snapshot/create.
func (c *Client) CreateSnapshot(ctx context.Context, s SnapshotCreate) error {
	return c.do(ctx, http.MethodPut, "/snapshot/create", s, nil)
}

// LoadSnapshot is PUT /snapshot/load.
func (c *Client) LoadSnapshot(ctx context.Context, s SnapshotLoad) error {
	return c.do(ctx, http.MethodPut, "/snapshot/load", s, nil)
}

// InstanceInfo is GET /.
func (c *Client) InstanceInfo(ctx context.Context) (InstanceInfo, error) {
	var i InstanceInfo
	err := c.do(ctx, http.MethodGet, "/", nil, &i)
	return i, err
}

func (c *Client) do(ctx context.Context, method, path string, in, out any) error {
	var body io.Reader
	if in != nil {
		b, err := json.Marshal(in)
		if err != nil {
			return errdefs.New(errdefs.ErrInternal, "firecracker %s %s request: %w", method, path, err)
		}
		body = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, "http://localhost"+path, body)
	if err != nil {
		return errdefs.New(errdefs.ErrInternal, "firecracker %s %s request: %w", method, path, err)
	}
	req.Header.Set("Accept", "application/json")
	if in != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		if ctx.Err() != nil {
			return fmt.Errorf("firecracker %s %s: %w", method, path, ctx.Err())
		}
		return errdefs.New(errdefs.ErrUnavailable, "firecracker api socket %s: %w", c.sock, err)
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return errdefs.New(errdefs.ErrUnavailable, "firecracker %s %s answer: %w", method, path, err)
	}
	if resp.StatusCode/100 != 2 {
		return faultError(method, path, resp.StatusCode, raw)
	}
	if out != nil {
		if err := json.Unmarshal(raw, out); err != nil {
			return errdefs.New(errdefs.ErrInternal, "firecracker %s %s answer %q: %w", method, path, raw, err)
		}
	}
	return nil
}

// faultError maps Firecracker's fault_message to an errdefs category.
// Firecracker answers 400 for both a bad body and a request the VM's state
// does not allow; the message tells them apart.
func faultError(method, path string, status int, raw []byte) error {
	var e apiError
	msg := strings.TrimSpace(string(raw))
	if json.Unmarshal(raw, &e) == nil && e.FaultMessage != "" {
		msg = e.FaultMessage
	}
	return errdefs.New(faultCategory(status, msg), "firecracker %s %s: %s", method, path, msg)
}

func faultCategory(status int, msg string) error {
	m := strings.ToLower(msg)
	switch {
	case status == http.StatusNotFound:
		return errdefs.ErrNotFound
	case status >= 500:
		return errdefs.ErrInternal
	case strings.Contains(m, "not supported") || strings.Contains(m, "not allowed") ||
		strings.Contains(m, "before") || strings.Contains(m, "after starting") ||
		strings.Contains(m, "already") || strings.Contains(m, "state"):
		return errdefs.ErrFailedPrecondition
	default:
		return errdefs.ErrInvalidArgument
	}
}
