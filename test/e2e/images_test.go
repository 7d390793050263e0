package e2e

import (
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	"connectrpc.com/connect"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/api/gen/opendsec/v1/opendsecv1connect"
)

func (s *system) images() opendsecv1connect.ImageServiceClient {
	return opendsecv1connect.NewImageServiceClient(s.httpClient(), s.endpoint, s.opts(s.token)...)
}

// importFiles imports a one-layer image of files (path -> content) with the
// offline `opendsec image import-rootfs`.
func (s *system) importFiles(t *testing.T, name string, files map[string]string) *opendsecv1.Image {
	t.Helper()
	dir := t.TempDir()
	for p, c := range files {
		if err := os.MkdirAll(filepath.Dir(filepath.Join(dir, p)), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, p), []byte(c), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	s.run("image", "import-rootfs", "--name", name, "--rootfs", dir)
	if s.endpoint == "" {
		return nil
	}
	r, err := s.images().GetImage(t.Context(), connect.NewRequest(&opendsecv1.GetImageRequest{Name: name}))
	if err != nil {
		t.Fatal(err)
	}
	return r.Msg.Image
}

// storeBytes is the bytes of every file in the image store but tmp/.
func (s *system) storeBytes(t *testing.T, sub string) int64 {
	t.Helper()
	var n int64
	filepath.WalkDir(filepath.Join(s.dataDir, "images", sub), func(p string, d fs.DirEntry, err error) error {
		if err == nil && d.Type().IsRegular() && !strings.Contains(p, "/images/tmp/") {
			if fi, err := d.Info(); err == nil {
				n += fi.Size()
			}
		}
		return nil
	})
	return n
}

// storeListing lists the store (but tmp/ and lock files) to show a call
// changed nothing.
func (s *system) storeListing(t *testing.T) []string {
	t.Helper()
	root := filepath.Join(s.dataDir, "images")
	var out []string
	filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		rel, _ := filepath.Rel(root, p)
		if err != nil || strings.HasPrefix(rel, "tmp") || rel == "lock" {
			return nil
		}
		out = append(out, rel)
		return nil
	})
	return out
}

// TestImagesComposePackDiffGC is issue 3's acceptance path through the
// public API: compose without copying layers, pack a sandbox's changes into
// an image that ten new sandboxes start from, collect garbage safely, and
// refuse bad input without touching the store.
func TestImagesComposePackDiffGC(t *testing.T) {
	s := newSystem(t)
	s.importFiles(t, "layers/ws", map[string]string{"work/ws.txt": "workspace"})
	s.importFiles(t, "layers/tk", map[string]string{"opt/tk/tool": "toolkit", "etc/tk.conf": "conf"})
	s.start()
	ctx := t.Context()
	ic := s.images()

	// Compose: base + a layer by digest + an image's layers.
	wsImg, err := ic.GetImage(ctx, connect.NewRequest(&opendsecv1.GetImageRequest{Name: "layers/ws"}))
	if err != nil {
		t.Fatal(err)
	}
	layersBefore, storeBefore := s.storeBytes(t, "layers"), s.storeBytes(t, "")
	comp, err := ic.ComposeImage(ctx, connect.NewRequest(&opendsecv1.ComposeImageRequest{
		Base: "root/busybox",
		Layers: []*opendsecv1.ComposeLayer{
			{Source: &opendsecv1.ComposeLayer_Digest{Digest: wsImg.Msg.Image.Layers[0].Digest}},
			{Source: &opendsecv1.ComposeLayer_Image{Image: "layers/tk"}},
		},
		Name: "team/env:v1",
	}))
	if err != nil {
		t.Fatal(err)
	}
	if n := len(comp.Msg.Image.Layers); n != 3 {
		t.Fatalf("composed image has %d layers, want 3", n)
	}
	if got := s.storeBytes(t, "layers"); got != layersBefore {
		t.Fatalf("compose copied layer bytes: layers/ went from %d to %d bytes", layersBefore, got)
	}
	if grew := s.storeBytes(t, "") - storeBefore; grew <= 0 || grew > 4096 {
		t.Fatalf("compose grew the store by %d bytes; want only a manifest and a ref (0 < n <= 4096)", grew)
	}
	env := s.create(t, &opendsecv1.SandboxSpec{Image: "team/env:v1"})
	if r := s.shell(t, env.Id, "cat /work/ws.txt /opt/tk/tool; busybox true && echo ok"); r.stdout != "workspacetoolkitok\n" {
		t.Fatalf("composed sandbox sees %q (stderr %q)", r.stdout, r.stderr)
	}

	// pack_diff: pip-install-like changes, a deleted lower file, a scrubbed
	// secret.
	r := s.shell(t, env.Id, "mkdir -p /usr/lib/py/site/pkg && echo 'v=1' > /usr/lib/py/site/pkg/__init__.py && "+
		"rm /opt/tk/tool && echo new > /etc/tk.conf && mkdir -p /root/.cache && echo tok > /root/.cache/secret && echo done")
	if r.stdout != "done\n" {
		t.Fatalf("changes: %q %q", r.stdout, r.stderr)
	}
	packed, err := ic.PackDiff(ctx, connect.NewRequest(&opendsecv1.PackDiffRequest{SandboxId: env.Id, Name: "team/env:packed", ScrubPaths: []string{"/root/.cache"}}))
	if err != nil {
		t.Fatal(err)
	}
	if n := len(packed.Msg.Image.Layers); n != 4 {
		t.Fatalf("packed image has %d layers, want 4", n)
	}
	const check = "cat /usr/lib/py/site/pkg/__init__.py /etc/tk.conf /work/ws.txt; test -e /opt/tk/tool && echo tool; test -e /root/.cache/secret && echo secret; echo end"
	var wg sync.WaitGroup
	outs := make([]string, 10)
	ids := make([]string, 10)
	for i := range 10 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rr, err := s.sandboxes().CreateSandbox(ctx, connect.NewRequest(&opendsecv1.CreateSandboxRequest{Spec: &opendsecv1.SandboxSpec{Image: "team/env:packed"}}))
			if err != nil {
				outs[i] = "create: " + err.Error()
				return
			}
			ids[i] = rr.Msg.Sandbox.Id
			res, err := s.exec(ctx, rr.Msg.Sandbox.Id, "/bin/sh", "-c", check)
			outs[i] = res.stdout
			if err != nil {
				outs[i] = "exec: " + err.Error()
			}
		}()
	}
	wg.Wait()
	for i, o := range outs {
		if o != "v=1\nnew\nworkspaceend\n" {
			t.Fatalf("sandbox %d (%s) of the packed image sees %q", i, ids[i], o)
		}
	}
	orig := s.create(t, &opendsecv1.SandboxSpec{Image: "team/env:v1"})
	if r := s.shell(t, orig.Id, check); r.stdout != "confworkspacetool\nend\n" {
		t.Fatalf("the original image changed: a new sandbox sees %q", r.stdout)
	}
	for _, id := range append(ids, orig.Id) {
		if _, err := s.sandboxes().StopSandbox(ctx, connect.NewRequest(&opendsecv1.StopSandboxRequest{Id: id})); err != nil {
			t.Fatal(err)
		}
	}

	// GC: an orphan goes; layers named or held by a running sandbox stay.
	orphan := s.importFiles(t, "orphan", map[string]string{"o": "orphan"})
	if _, err := ic.RemoveImage(ctx, connect.NewRequest(&opendsecv1.RemoveImageRequest{Name: "orphan"})); err != nil {
		t.Fatal(err)
	}
	// env still runs from team/env:v1; drop every name of it.
	for _, n := range []string{"team/env:v1", "layers/tk"} {
		if _, err := ic.RemoveImage(ctx, connect.NewRequest(&opendsecv1.RemoveImageRequest{Name: n})); err != nil {
			t.Fatal(err)
		}
	}
	gc, err := ic.GarbageCollect(ctx, connect.NewRequest(&opendsecv1.GarbageCollectRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(gc.Msg.RemovedLayers, []string{orphan.Layers[0].Digest}) {
		t.Fatalf("gc removed %v, want only the orphan %s", gc.Msg.RemovedLayers, orphan.Layers[0].Digest)
	}
	if r := s.shell(t, env.Id, "cat /work/ws.txt && ls /bin/busybox"); r.exit.ExitCode != 0 {
		t.Fatalf("held sandbox after gc: %q %q", r.stdout, r.stderr)
	}
	again := s.create(t, &opendsecv1.SandboxSpec{Image: "team/env:packed"})
	if r := s.shell(t, again.Id, check); r.stdout != "v=1\nnew\nworkspaceend\n" {
		t.Fatalf("packed image after gc: %q", r.stdout)
	}
	v, err := ic.VerifyImages(ctx, connect.NewRequest(&opendsecv1.VerifyImagesRequest{}))
	if err != nil || len(v.Msg.Corrupt) != 0 || v.Msg.Checked == 0 {
		t.Fatalf("verify: %v %v", v, err)
	}

	// Bad input: clear errors naming the field; the store unchanged.
	before := s.storeListing(t)
	digest := packed.Msg.Image.Layers[0].Digest
	cases := []struct {
		what    string
		call    func() error
		code    connect.Code
		mention string
	}{
		{"get unknown tag", func() error {
			_, err := ic.GetImage(ctx, connect.NewRequest(&opendsecv1.GetImageRequest{Name: "team/env:nope"}))
			return err
		}, connect.CodeNotFound, "team/env:nope"},
		{"compose unknown layer", func() error {
			_, err := ic.ComposeImage(ctx, connect.NewRequest(&opendsecv1.ComposeImageRequest{Base: "root/busybox", Name: "x", Layers: []*opendsecv1.ComposeLayer{{Source: &opendsecv1.ComposeLayer_Digest{Digest: "sha256:" + strings.Repeat("0", 64)}}}}))
			return err
		}, connect.CodeNotFound, "layers[0].digest"},
		{"compose bad digest", func() error {
			_, err := ic.ComposeImage(ctx, connect.NewRequest(&opendsecv1.ComposeImageRequest{Base: "root/busybox", Name: "x", Layers: []*opendsecv1.ComposeLayer{{Source: &opendsecv1.ComposeLayer_Digest{Digest: digest}}, {Source: &opendsecv1.ComposeLayer_Digest{Digest: "md5:abc"}}}}))
			return err
		}, connect.CodeInvalidArgument, "layers[1].digest"},
		{"compose unknown base", func() error {
			_, err := ic.ComposeImage(ctx, connect.NewRequest(&opendsecv1.ComposeImageRequest{Base: "no/such", Name: "x"}))
			return err
		}, connect.CodeNotFound, "base"},
		{"compose invalid name", func() error {
			_, err := ic.ComposeImage(ctx, connect.NewRequest(&opendsecv1.ComposeImageRequest{Base: "root/busybox", Name: "Bad Name!"}))
			return err
		}, connect.CodeInvalidArgument, "name"},
		{"tag unknown", func() error {
			_, err := ic.TagImage(ctx, connect.NewRequest(&opendsecv1.TagImageRequest{Source: "no/such", Target: "y"}))
			return err
		}, connect.CodeNotFound, "source"},
		{"remove unknown", func() error {
			_, err := ic.RemoveImage(ctx, connect.NewRequest(&opendsecv1.RemoveImageRequest{Name: "no/such:v1"}))
			return err
		}, connect.CodeNotFound, "no/such:v1"},
		{"pack unknown sandbox", func() error {
			_, err := ic.PackDiff(ctx, connect.NewRequest(&opendsecv1.PackDiffRequest{SandboxId: "n001" + strings.Repeat("a", 16), Name: "p"}))
			return err
		}, connect.CodeNotFound, "sandbox_id"},
		{"pack empty sandbox", func() error {
			_, err := ic.PackDiff(ctx, connect.NewRequest(&opendsecv1.PackDiffRequest{Name: "p"}))
			return err
		}, connect.CodeInvalidArgument, "sandbox_id"},
		{"pack invalid name", func() error {
			_, err := ic.PackDiff(ctx, connect.NewRequest(&opendsecv1.PackDiffRequest{SandboxId: again.Id, Name: "../x"}))
			return err
		}, connect.CodeInvalidArgument, "name"},
		{"pack relative scrub", func() error {
			_, err := ic.PackDiff(ctx, connect.NewRequest(&opendsecv1.PackDiffRequest{SandboxId: again.Id, Name: "p", ScrubPaths: []string{"root/.cache"}}))
			return err
		}, connect.CodeInvalidArgument, "scrub_paths[0]"},
	}
	for _, c := range cases {
		wantErr(t, c.what, c.call(), c.code, c.mention)
		if after := s.storeListing(t); !slices.Equal(before, after) {
			t.Fatalf("%s changed the store:\nbefore %q\nafter  %q", c.what, before, after)
		}
	}
	fmt.Fprintln(os.Stderr, "images e2e: ok")
}
