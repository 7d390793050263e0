package microvm

import (
	"net"
	"net/http"
	"os"
	"path/filepath"
	"testing"

	"github.com/kernflux/opendsec/internal/runtime/microvm/fcfake"
)

// fakeFC is fcfake's API server on a unix socket in this process: it
// validates bodies against the v1.16.1 schema and keeps Firecracker's
// state machine (configure, start, pause, snapshot, load).
type fakeFC struct {
	*fcfake.Server
	sock string
}

type schema = fcfake.Schema

var (
	schemaMachineConfig    = fcfake.SchemaMachineConfig
	schemaBootSource       = fcfake.SchemaBootSource
	schemaDrive            = fcfake.SchemaDrive
	schemaNetworkInterface = fcfake.SchemaNetworkInterface
	schemaVsock            = fcfake.SchemaVsock
	schemaBalloon          = fcfake.SchemaBalloon
	schemaLogger           = fcfake.SchemaLogger
	schemaMetrics          = fcfake.SchemaMetrics
	schemaAction           = fcfake.SchemaAction
	schemaVM               = fcfake.SchemaVM
	schemaSnapshotCreate   = fcfake.SchemaSnapshotCreate
	schemaSnapshotLoad     = fcfake.SchemaSnapshotLoad
)

func newFakeFC(t *testing.T) *fakeFC {
	t.Helper()
	dir, err := os.MkdirTemp("", "fc") // short: sun_path is 108 bytes
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	f := &fakeFC{Server: fcfake.NewServer("anonymous-instance"), sock: filepath.Join(dir, "api.sock")}
	ln, err := net.Listen("unix", f.sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: f.Server}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close() })
	return f
}

func (f *fakeFC) client() *Client { return NewClient(f.sock) }

func (f *fakeFC) body(call string) []byte { return f.Body(call) }
