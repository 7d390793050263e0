package image

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-containerregistry/pkg/compression"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"

	"github.com/kernflux/opendsec/internal/errdefs"
)

// TestImportDirRestrictsArchives checks a store opened WithImportDir reads
// archives only from under that directory: paths outside it, '..' escapes
// and symlinks out of it are refused with one message that does not say
// whether the path exists, and the store is unchanged.
func TestImportDirRestrictsArchives(t *testing.T) {
	ctx := t.Context()
	tmp := t.TempDir()
	imp := filepath.Join(tmp, "import")
	if err := os.Mkdir(imp, 0o755); err != nil {
		t.Fatal(err)
	}
	s := openStore(t, filepath.Join(tmp, "images"), WithFormat(FormatDir), WithImportDir(imp))
	img, err := mutate.AppendLayers(empty.Image, layerOf(t, compression.GZip, fileE("a", "a")))
	if err != nil {
		t.Fatal(err)
	}
	outLayout := writeLayout(t, map[string]v1.Image{"v1": img})
	outArchive := writeDockerArchive(t, map[string]v1.Image{"team/app:v1": img})
	if err := os.Rename(writeLayout(t, map[string]v1.Image{"v1": img}), filepath.Join(imp, "app")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(outLayout, filepath.Join(imp, "link")); err != nil {
		t.Fatal(err)
	}
	before := storeBytes(t, s)
	var msgs []string
	for _, ref := range []string{
		SchemeOCILayout + outLayout + ":v1",
		SchemeOCILayout + "/no/such/dir:v1",
		SchemeDockerArchive + outArchive,
		SchemeDockerArchive + "/etc/shadow",
		SchemeDockerArchive + "/no/such/file.tar",
		SchemeOCILayout + imp + "/../" + filepath.Base(tmp) + "/x:v1",
		SchemeOCILayout + imp + "/link:v1",
		SchemeOCILayout + "relative/app:v1",
		SchemeOCILayout + imp + "/",
	} {
		_, err := s.Import(ctx, ref)
		if !errdefs.IsInvalidArgument(err) || !strings.HasPrefix(err.Error(), "ref: ") {
			t.Fatalf("import %s: %v, want an invalid ref error", ref, err)
		}
		msgs = append(msgs, err.Error())
	}
	for _, m := range msgs[1:] {
		if m != msgs[0] {
			t.Fatalf("refusals differ (they must not reveal whether a path exists):\n%s\n%s", msgs[0], m)
		}
	}
	if !strings.Contains(msgs[0], imp) {
		t.Fatalf("refusal %q does not name the import directory", msgs[0])
	}
	if got := storeBytes(t, s); strings.Join(got, "\n") != strings.Join(before, "\n") {
		t.Fatalf("refused imports changed the store")
	}
	if _, err := s.Import(ctx, SchemeOCILayout+filepath.Join(imp, "app")+":v1", WithName("team/app:v1")); err != nil {
		t.Fatalf("import from under the import dir: %v", err)
	}
}
