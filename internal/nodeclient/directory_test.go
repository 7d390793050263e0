package nodeclient_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/nodeclient"
)

func TestStaticDirectory(t *testing.T) {
	d, err := nodeclient.NewStaticDirectory(
		nodeclient.NodeInfo{ID: "n002", Addr: "http://10.0.0.2:7071/"},
		nodeclient.NodeInfo{ID: "n001", Addr: "https://node1.example:7071"},
	)
	if err != nil {
		t.Fatal(err)
	}
	n, err := d.Lookup(t.Context(), "n002")
	if err != nil || n.Addr != "http://10.0.0.2:7071" {
		t.Fatalf("Lookup(n002) = %+v, %v; want the address without its trailing slash", n, err)
	}
	all, err := d.List(t.Context())
	if err != nil || len(all) != 2 || all[0].ID != "n002" || all[1].ID != "n001" {
		t.Fatalf("List = %+v, %v; want the configured order", all, err)
	}
	all[0].Addr = "changed"
	if again, _ := d.List(t.Context()); again[0].Addr != "http://10.0.0.2:7071" {
		t.Fatal("List hands out the directory's own slice")
	}

	_, err = d.Lookup(t.Context(), "n009")
	if !errdefs.IsNotFound(err) {
		t.Fatalf("unknown node: %v, want not_found", err)
	}
	for _, want := range []string{"n009", "2 configured nodes", "nodes[]"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("unknown node error %q does not say %q", err, want)
		}
	}
}

func TestStaticDirectoryRefusesBadNodes(t *testing.T) {
	ok := nodeclient.NodeInfo{ID: "n001", Addr: "http://127.0.0.1:7071"}
	for _, tc := range []struct {
		name  string
		nodes []nodeclient.NodeInfo
		field string
	}{
		{"short id", []nodeclient.NodeInfo{ok, {ID: "n1", Addr: "http://h:1"}}, "nodes[1].id"},
		{"upper case id", []nodeclient.NodeInfo{{ID: "N001", Addr: "http://h:1"}}, "nodes[0].id"},
		{"twice", []nodeclient.NodeInfo{ok, ok}, "nodes[1].id"},
		{"no scheme", []nodeclient.NodeInfo{{ID: "n001", Addr: "127.0.0.1:7071"}}, "nodes[0].address"},
		{"empty address", []nodeclient.NodeInfo{{ID: "n001"}}, "nodes[0].address"},
		{"other scheme", []nodeclient.NodeInfo{{ID: "n001", Addr: "unix:///run/node.sock"}}, "nodes[0].address"},
		{"query", []nodeclient.NodeInfo{{ID: "n001", Addr: "http://h:1/?x=1"}}, "nodes[0].address"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := nodeclient.NewStaticDirectory(tc.nodes...)
			var fe *errdefs.FieldError
			if !errors.As(err, &fe) || fe.Field != tc.field {
				t.Fatalf("err = %v, want invalid_argument for %s", err, tc.field)
			}
		})
	}
}

// movingDirectory is a Directory whose nodes the test changes, like one of
// registered nodes would.
type movingDirectory struct {
	mu    sync.Mutex
	nodes map[string]nodeclient.NodeInfo
	fail  error
}

func (d *movingDirectory) Lookup(_ context.Context, id string) (nodeclient.NodeInfo, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.fail != nil {
		return nodeclient.NodeInfo{}, d.fail
	}
	n, ok := d.nodes[id]
	if !ok {
		return nodeclient.NodeInfo{}, errdefs.New(errdefs.ErrNotFound, "node %s is not registered", id)
	}
	return n, nil
}

func (d *movingDirectory) List(context.Context) ([]nodeclient.NodeInfo, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.fail != nil {
		return nil, d.fail
	}
	var out []nodeclient.NodeInfo
	for _, id := range []string{"n001", "n002"} {
		if n, ok := d.nodes[id]; ok {
			out = append(out, n)
		}
	}
	return out, nil
}

func TestPool(t *testing.T) {
	d := &movingDirectory{nodes: map[string]nodeclient.NodeInfo{
		"n001": {ID: "n001", Addr: "http://10.0.0.1:7071"},
		"n002": {ID: "n002", Addr: "http://10.0.0.2:7071"},
	}}
	p := nodeclient.NewPool(d, nodeclient.Options{})
	a, err := p.Get(t.Context(), "n001")
	if err != nil {
		t.Fatal(err)
	}
	if b, _ := p.Get(t.Context(), "n001"); b != a {
		t.Fatal("a second Get made a second client")
	}
	if c, _ := p.ForSandbox(t.Context(), "id", "n001aaaaaaaaaaaaaaaa"); c != a {
		t.Fatal("ForSandbox did not route to the node's cached client")
	}
	all, err := p.List(t.Context())
	if err != nil || len(all) != 2 || all[0] != a || all[1].ID() != "n002" {
		t.Fatalf("List = %v, %v", all, err)
	}

	// The node moves: the next Get reaches it at its new address.
	d.mu.Lock()
	d.nodes["n001"] = nodeclient.NodeInfo{ID: "n001", Addr: "http://10.0.0.9:7071"}
	d.mu.Unlock()
	moved, err := p.Get(t.Context(), "n001")
	if err != nil || moved == a || moved.Info().Addr != "http://10.0.0.9:7071" {
		t.Fatalf("after the move: %+v, %v", moved.Info(), err)
	}

	// A directory that cannot answer: the error is its own, not not_found.
	d.mu.Lock()
	d.fail = errdefs.New(errdefs.ErrUnavailable, "registry down")
	d.mu.Unlock()
	_, err = p.ForSandbox(t.Context(), "id", "n001aaaaaaaaaaaaaaaa")
	if !errors.Is(err, errdefs.ErrUnavailable) || !strings.Contains(err.Error(), "n001aaaaaaaaaaaaaaaa") || !strings.Contains(err.Error(), "registry down") {
		t.Fatalf("directory down: %v, want unavailable naming the sandbox and the cause", err)
	}
}

func TestPoolForSandbox(t *testing.T) {
	d, err := nodeclient.NewStaticDirectory(nodeclient.NodeInfo{ID: "n001", Addr: "http://127.0.0.1:7071"})
	if err != nil {
		t.Fatal(err)
	}
	p := nodeclient.NewPool(d, nodeclient.Options{})
	for _, tc := range []struct {
		id   string
		cat  error
		want []string
	}{
		{"", errdefs.ErrInvalidArgument, []string{"sandbox_id", "is empty"}},
		{"n001", errdefs.ErrInvalidArgument, []string{"sandbox_id", "not a sandbox ID"}},
		{"N001AAAAAAAAAAAAAAAA", errdefs.ErrInvalidArgument, []string{"sandbox_id"}},
		{"n009aaaaaaaaaaaaaaaa", errdefs.ErrNotFound, []string{"sandbox n009aaaaaaaaaaaaaaaa not found", "node n009", "nodes[]"}},
	} {
		_, err := p.ForSandbox(t.Context(), "sandbox_id", tc.id)
		if !errors.Is(err, tc.cat) {
			t.Errorf("ForSandbox(%q) = %v, want category %v", tc.id, err, tc.cat)
			continue
		}
		for _, w := range tc.want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("ForSandbox(%q) = %q, want it to say %q", tc.id, err, w)
			}
		}
	}
	c, err := p.ForSandbox(t.Context(), "sandbox_id", "n001aaaaaaaaaaaaaaaa")
	if err != nil || c.ID() != "n001" {
		t.Fatalf("ForSandbox = %v, %v", c, err)
	}
}
