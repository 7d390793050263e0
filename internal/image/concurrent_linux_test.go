package image

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"io"
	"io/fs"
	"math/rand/v2"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/compression"
	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/mutate"

	"github.com/kernflux/opendsec/internal/testutil"
)

// nodeImportEnv makes the test binary a node process that imports one image
// (see TestNodeProcessImportHelper): "storeDir|ref|readyFile|goFile".
const nodeImportEnv = "OPENDSEC_IMAGE_TEST_NODE_IMPORT"

// TestNodeProcessImportHelper is not a test: it is the body of one node
// process of TestTwoNodeProcessesImportConcurrently, run by re-executing the
// test binary. It opens the shared store, says it is ready, waits for the
// go signal, imports and prints the image as JSON.
func TestNodeProcessImportHelper(t *testing.T) {
	spec := os.Getenv(nodeImportEnv)
	if spec == "" {
		t.Skip("helper process of TestTwoNodeProcessesImportConcurrently")
	}
	parts := strings.Split(spec, "|")
	if len(parts) != 4 {
		t.Fatalf("%s=%q: want storeDir|ref|readyFile|goFile", nodeImportEnv, spec)
	}
	s, err := Open(parts[0], WithMountDir(parts[0]+".mounts"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(parts[2], nil, 0o644); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the go signal", func() bool { _, err := os.Stat(parts[3]); return err == nil })
	img, err := s.Import(context.Background(), parts[1], WithInternalRegistry(), WithName("shared/img:v1"))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.NewEncoder(os.Stdout).Encode(img); err != nil {
		t.Fatal(err)
	}
}

// waitFor polls cond until it holds, failing after 60s.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// rendezvousBlobs is the registry's in-memory blob store, except that a GET
// of the blob gate is held until want GETs of it are in flight: every
// importer is then provably downloading the same layer at the same moment.
type rendezvousBlobs struct {
	mem  registry.BlobHandler
	gate v1.Hash
	want int

	mu      sync.Mutex
	arrived int           // guarded by mu
	all     chan struct{} // closed when arrived reaches want
	gets    map[v1.Hash]int
}

func (b *rendezvousBlobs) Get(ctx context.Context, repo string, h v1.Hash) (io.ReadCloser, error) {
	b.mu.Lock()
	b.gets[h]++
	if h == b.gate {
		b.arrived++
		if b.arrived == b.want {
			close(b.all)
		}
	}
	b.mu.Unlock()
	if h == b.gate {
		select {
		case <-b.all:
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(60 * time.Second):
			return nil, fmt.Errorf("only %d of %d importers fetched layer %s", b.arrived, b.want, h)
		}
	}
	return b.mem.Get(ctx, repo, h)
}

func (b *rendezvousBlobs) Stat(ctx context.Context, repo string, h v1.Hash) (int64, error) {
	return b.mem.(registry.BlobStatHandler).Stat(ctx, repo, h)
}

func (b *rendezvousBlobs) Put(ctx context.Context, repo string, h v1.Hash, rc io.ReadCloser) error {
	return b.mem.(registry.BlobPutHandler).Put(ctx, repo, h, rc)
}

// randomLayer is one file of n incompressible bytes.
func randomLayer(t *testing.T, name string, n int, seed uint64) (v1.Layer, string) {
	t.Helper()
	body := make([]byte, n)
	r := rand.New(rand.NewPCG(seed, seed))
	for i := range body {
		body[i] = byte(r.Uint32())
	}
	return layerOf(t, compression.GZip, ent{name: name, body: string(body), typ: tar.TypeReg}), fmt.Sprintf("%x", sha256.Sum256(body))
}

// hashedTree is treeOf with file contents replaced by their sha256.
func hashedTree(t *testing.T, root string) []string {
	t.Helper()
	var out []string
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		switch {
		case rel == ".":
		case d.IsDir():
			out = append(out, rel+"/")
		case d.Type().IsRegular():
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			out = append(out, fmt.Sprintf("%s=%x", rel, sha256.Sum256(b)))
		default:
			out = append(out, rel+" "+d.Type().String())
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// TestTwoNodeProcessesImportConcurrently is issue 3's acceptance test: two
// node processes sharing one store import the same multi-layer image from a
// registry on loopback at the same moment. The store ends with one copy of
// each layer, both get the same image, every layer re-hashes to its
// recorded digest, a sandbox sees the right tree, and no temp files remain.
func TestTwoNodeProcessesImportConcurrently(t *testing.T) {
	testutil.RequiresRoot(t)
	ctx := t.Context()
	base := whiteoutImage(t)
	big1, sum1 := randomLayer(t, "big1", 8<<20, 1)
	big2, sum2 := randomLayer(t, "big2", 8<<20, 2)
	img, err := mutate.AppendLayers(base, big1, big2)
	if err != nil {
		t.Fatal(err)
	}
	gate, _ := big1.Digest()
	blobs := &rendezvousBlobs{mem: registry.NewInMemoryBlobHandler(), gate: gate, want: 2, all: make(chan struct{}), gets: map[v1.Hash]int{}}
	srv := httptest.NewServer(registry.New(registry.WithBlobHandler(blobs), registry.Logger(discardLogger())))
	t.Cleanup(srv.Close)
	ref := strings.TrimPrefix(srv.URL, "http://") + "/team/shared:v1"
	pushIndex(t, ref, img)
	blobs.mu.Lock()
	clear(blobs.gets) // count only the importers' fetches
	blobs.mu.Unlock()

	work := t.TempDir()
	storeDir := filepath.Join(work, "images")
	s := openStore(t, storeDir) // created up front, as an installed cluster's store is
	goFile := filepath.Join(work, "go")
	var cmds []*exec.Cmd
	var outs, errs []*bytes.Buffer
	var readies []string
	for i := range 2 {
		ready := filepath.Join(work, fmt.Sprintf("ready%d", i))
		readies = append(readies, ready)
		cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^TestNodeProcessImportHelper$", "-test.count=1")
		cmd.Env = append(os.Environ(), nodeImportEnv+"="+strings.Join([]string{storeDir, ref, ready, goFile}, "|"))
		var out, stderr bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &stderr
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		cmds, outs, errs = append(cmds, cmd), append(outs, &out), append(errs, &stderr)
	}
	waitFor(t, "both node processes to open the store", func() bool {
		for _, r := range readies {
			if _, err := os.Stat(r); err != nil {
				return false
			}
		}
		return true
	})
	if err := os.WriteFile(goFile, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	var got []Image
	for i, c := range cmds {
		if err := c.Wait(); err != nil {
			t.Fatalf("node process %d: %v\nstdout: %s\nstderr: %s", i, err, outs[i], errs[i])
		}
		// The JSON line is the one starting with '{' (go test prints PASS too).
		var im Image
		for _, line := range strings.Split(outs[i].String(), "\n") {
			if strings.HasPrefix(line, "{") {
				if err := json.Unmarshal([]byte(line), &im); err != nil {
					t.Fatal(err)
				}
			}
		}
		if im.ID == "" {
			t.Fatalf("node process %d printed no image:\n%s", i, outs[i])
		}
		got = append(got, im)
	}

	// Both downloaded the gated layer: the imports really overlapped.
	blobs.mu.Lock()
	gateGets := blobs.gets[gate]
	blobs.mu.Unlock()
	if gateGets != 2 {
		t.Fatalf("layer %s fetched %d times; want 2 (one per node process)", gate, gateGets)
	}
	if got[0].ID != got[1].ID || !slices.Equal(got[0].Layers, got[1].Layers) || len(got[0].Layers) != 5 {
		t.Fatalf("node processes got different images:\n%+v\n%+v", got[0], got[1])
	}

	// One copy of each layer, and each re-hashes to what layer.json says.
	dirs := contentDirs(t, s)
	var want []string
	for _, l := range got[0].Layers {
		h, _ := digestHex(l.Digest)
		want = append(want, h)
	}
	slices.Sort(want)
	if !slices.Equal(dirs, want) {
		t.Fatalf("layers in the store = %v; want exactly %v", dirs, want)
	}
	for _, h := range dirs {
		li, err := s.readLayer("sha256:" + h)
		if err != nil {
			t.Fatal(err)
		}
		if li.Format != FormatEROFS {
			t.Fatalf("layer %s is %s; want erofs", h, li.Format)
		}
		d, n, err := fileDigest(s.path("layers", h, "layer.erofs"))
		if err != nil {
			t.Fatal(err)
		}
		if d != li.FileDigest || n != li.FileSize {
			t.Errorf("layer %s: layer.erofs is %s (%d bytes); layer.json says %s (%d bytes)", h, d, n, li.FileDigest, li.FileSize)
		}
		ents, _ := os.ReadDir(s.path("layers", h))
		var names []string
		for _, e := range ents {
			names = append(names, e.Name())
		}
		if !slices.Equal(names, []string{"layer.erofs", "layer.json"}) {
			t.Errorf("layer %s holds %v; want layer.erofs and layer.json only", h, names)
		}
	}

	if res, err := s.Verify(ctx); err != nil || res.Checked != 5 || len(res.Corrupt) != 0 {
		t.Fatalf("Verify = %+v, %v; want 5 layers checked, none corrupt", res, err)
	}

	// No stray temp files anywhere in the store.
	if tmp := tmpEntries(t, s); len(tmp) != 0 {
		t.Errorf("tmp/ left behind: %v", tmp)
	}
	filepath.WalkDir(s.Dir(), func(p string, d fs.DirEntry, err error) error {
		if err == nil && strings.HasPrefix(d.Name(), ".tmp-") {
			t.Errorf("stray temp file %s", p)
		}
		return nil
	})
	if refs, _ := os.ReadDir(s.path("refs")); len(refs) != 1 {
		t.Errorf("refs = %v; want one", refs)
	}

	// The image a sandbox sees: the whiteout layers plus both big files.
	ri, err := s.Hold(ctx, "shared/img:v1", "sbx")
	if err != nil {
		t.Fatal(err)
	}
	defer s.Release(context.WithoutCancel(ctx), "sbx")
	mnt := overlayRoot(t, heldDirs(t, ri, "sbx"))
	wantTree := []string{
		"big1=" + sum1, "big2=" + sum2, "etc/",
		fmt.Sprintf("etc/b=%x", sha256.Sum256([]byte("b2"))),
		fmt.Sprintf("hl1=%x", sha256.Sum256([]byte("same"))),
		fmt.Sprintf("hl2=%x", sha256.Sum256([]byte("same"))),
		"opq/", fmt.Sprintf("opq/new=%x", sha256.Sum256([]byte("new"))),
		fmt.Sprintf("top=%x", sha256.Sum256([]byte("t"))),
	}
	if tree := hashedTree(t, mnt); !slices.Equal(tree, wantTree) {
		t.Fatalf("sandbox root:\n got %q\nwant %q", tree, wantTree)
	}
}
