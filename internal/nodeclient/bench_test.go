package nodeclient_test

import (
	"fmt"
	"testing"

	"github.com/kernflux/opendsec/internal/nodeclient"
	"github.com/kernflux/opendsec/internal/sandboxid"
)

// BenchmarkForSandbox is the routing cost every sandbox call now pays: ID
// check, directory lookup, cached client (1000 configured nodes).
func BenchmarkForSandbox(b *testing.B) {
	var nodes []nodeclient.NodeInfo
	for i := range 1000 {
		nodes = append(nodes, nodeclient.NodeInfo{ID: fmt.Sprintf("n%03d", i), Addr: fmt.Sprintf("http://10.0.%d.%d:7071", i/256, i%256)})
	}
	d, err := nodeclient.NewStaticDirectory(nodes...)
	if err != nil {
		b.Fatal(err)
	}
	p := nodeclient.NewPool(d, nodeclient.Options{})
	ctx := b.Context()
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if _, err := p.ForSandbox(ctx, "id", "n517aaaaaaaaaaaaaaaa"); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// BenchmarkSandboxIDCheck is the part of ForSandbox the apiserver paid
// before the directory (the ID's format check), for comparison.
func BenchmarkSandboxIDCheck(b *testing.B) {
	for b.Loop() {
		if _, err := sandboxid.Node("id", "n517aaaaaaaaaaaaaaaa"); err != nil {
			b.Fatal(err)
		}
	}
}
