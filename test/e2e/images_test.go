//go:build linux

package e2e

import (
	"fmt"
	"io"
	"io/fs"
	"log"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	"connectrpc.com/connect"
	"github.com/google/go-containerregistry/pkg/crane"
	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/api/gen/opendsec/v1/opendsecv1connect"
	opendsec "github.com/kernflux/opendsec/sdk/go"
	"github.com/kernflux/opendsec/test/harness"
)

func (s *system) images() opendsecv1connect.ImageServiceClient {
	return opendsecv1connect.NewImageServiceClient(s.HTTPClient(), s.Endpoint(), s.Opts(s.Token())...)
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
	s.Run("image", "import-rootfs", "--name", name, "--rootfs", dir)
	if s.Endpoint() == "" {
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
	filepath.WalkDir(filepath.Join(s.DataDir(), "images", sub), func(p string, d fs.DirEntry, err error) error {
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
	s.waitTeardowns(t)
	root := filepath.Join(s.DataDir(), "images")
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
	s.Start()
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
			rr, err := s.Sandboxes().CreateSandbox(ctx, connect.NewRequest(&opendsecv1.CreateSandboxRequest{Spec: &opendsecv1.SandboxSpec{Image: "team/env:packed"}}))
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
		if _, err := s.Sandboxes().StopSandbox(ctx, connect.NewRequest(&opendsecv1.StopSandboxRequest{Id: id})); err != nil {
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

// ctl runs the opendsecctl binary (built once) against the system.
func (s *system) ctl(t *testing.T, args ...string) (stdout, stderr string, code int) {
	t.Helper()
	cmd := exec.CommandContext(t.Context(), harness.Binary(t, "opendsecctl"), args...)
	cmd.Env = append(os.Environ(), "OPENDSEC_ENDPOINT="+s.Endpoint(), "OPENDSEC_TOKEN="+s.Token())
	var out, errb strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	code = cmd.ProcessState.ExitCode()
	if err != nil && code < 0 {
		t.Fatalf("opendsecctl %v: %v", args, err)
	}
	return out.String(), errb.String(), code
}

// TestImagesRegistryCLIAndGoSDK imports from a registry on loopback with
// the CLI (merged layers, progress on stderr), composes it onto busybox
// and packs a sandbox with the Go SDK.
func TestImagesRegistryCLIAndGoSDK(t *testing.T) {
	s := newSystem(t)
	s.Start()
	ctx := t.Context()
	srv := httptest.NewServer(registry.New(registry.Logger(log.New(io.Discard, "", 0))))
	defer srv.Close()
	host := strings.TrimPrefix(srv.URL, "http://")
	l1, err := crane.Layer(map[string][]byte{"app/one": []byte("1"), "app/gone": []byte("g")})
	if err != nil {
		t.Fatal(err)
	}
	l2, err := crane.Layer(map[string][]byte{"app/two": []byte("2"), "app/.wh.gone": nil})
	if err != nil {
		t.Fatal(err)
	}
	img, err := mutate.AppendLayers(empty.Image, l1, l2)
	if err != nil {
		t.Fatal(err)
	}
	cf, _ := img.ConfigFile()
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture = "linux", "amd64"
	if img, err = mutate.ConfigFile(img, cf); err != nil {
		t.Fatal(err)
	}
	ref := host + "/team/app:v1"
	r, err := name.ParseReference(ref)
	if err != nil {
		t.Fatal(err)
	}
	if err := remote.Write(r, img, remote.WithContext(ctx)); err != nil {
		t.Fatal(err)
	}

	out, errOut, code := s.ctl(t, "image", "import", ref, "--merge-layers", "--name", "team/app:v1")
	if code != 0 || !strings.Contains(out, "team/app:v1") || !strings.Contains(errOut, "pulling "+ref) {
		t.Fatalf("image import: exit %d\nstdout %s\nstderr %s", code, out, errOut)
	}
	out, _, code = s.ctl(t, "image", "compose", "root/busybox", "team/app:env", "--image", "team/app:v1", "--env", "APP=1")
	if code != 0 {
		t.Fatalf("image compose: exit %d %s", code, out)
	}
	out, _, _ = s.ctl(t, "image", "list")
	for _, n := range []string{"root/busybox:latest", "team/app:v1", "team/app:env"} {
		if !strings.Contains(out, n) {
			t.Fatalf("image list lacks %s:\n%s", n, out)
		}
	}

	c, err := opendsec.New(s.Endpoint(), opendsec.WithToken(s.Token()))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	app, err := c.GetImage(ctx, "team/app:v1")
	if err != nil {
		t.Fatal(err)
	}
	if len(app.Layers) != 1 {
		t.Fatalf("--merge-layers left %d layers, want 1", len(app.Layers))
	}
	sb, err := c.CreateSandbox(ctx, &opendsec.SandboxSpec{Image: "team/app:env"})
	if err != nil {
		t.Fatal(err)
	}
	res := s.shell(t, sb.Id, "cat /app/one /app/two; ls /app; echo $APP")
	if res.stdout != "12one\ntwo\n1\n" {
		t.Fatalf("sandbox of the imported, merged, composed image sees %q (stderr %q)", res.stdout, res.stderr)
	}
	s.shell(t, sb.Id, "echo three > /app/three && rm /app/one")
	out, errOut, code = s.ctl(t, "sandbox", "pack-diff", sb.Id, "team/app:packed", "-o", "json")
	if code != 0 || !strings.Contains(out, `"team/app:packed"`) {
		t.Fatalf("pack-diff: exit %d\n%s\n%s", code, out, errOut)
	}
	sb2, err := c.CreateSandbox(ctx, &opendsec.SandboxSpec{Image: "team/app:packed"})
	if err != nil {
		t.Fatal(err)
	}
	if res := s.shell(t, sb2.Id, "ls /app; echo $APP"); res.stdout != "three\ntwo\n1\n" {
		t.Fatalf("sandbox of the packed image sees %q", res.stdout)
	}
	if _, err := c.TagImage(ctx, "team/app:packed", "team/app:stable"); err != nil {
		t.Fatal(err)
	}
	if _, err := c.PackDiff(ctx, "n001"+strings.Repeat("z", 16), "x"); !opendsec.IsNotFound(err) {
		t.Fatalf("pack-diff of an unknown sandbox: %v, want not found", err)
	}
	_, errOut, code = s.ctl(t, "image", "inspect", "team/app:nope")
	if code != 1 || !strings.Contains(errOut, "team/app:nope") {
		t.Fatalf("inspect unknown: exit %d %s", code, errOut)
	}
	_, errOut, code = s.ctl(t, "image", "import", "127.0.0.1:1/nothing:v1", "-q")
	if code != 1 || !strings.Contains(errOut, "127.0.0.1:1") {
		t.Fatalf("import from an unreachable registry: exit %d %s", code, errOut)
	}
	out, errOut, code = s.ctl(t, "image", "verify")
	if code != 0 || !strings.Contains(errOut, "0 damaged") {
		t.Fatalf("verify: exit %d %s %s", code, out, errOut)
	}
}
