package image

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/testutil"
)

// Re-exec hook for the two-process test: the child imports and exits.
const helperEnv = "OPENDSEC_IMAGE_TEST_IMPORT"

func TestMain(m *testing.M) {
	if spec := os.Getenv(helperEnv); spec != "" {
		// spec: storeDir|name|srcDir
		parts := strings.Split(spec, "|")
		s, err := Open(parts[0], WithMountDir(parts[0]+".mounts"))
		if err == nil {
			_, err = s.ImportDir(context.Background(), parts[1], parts[2], Config{})
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

func newStore(t *testing.T) *Store {
	t.Helper()
	return openStore(t, filepath.Join(t.TempDir(), "images"))
}

// openStore opens dir with its mounts next to it (not in /run) and
// unmounts whatever the test left mounted.
func openStore(t *testing.T, dir string, opts ...Option) *Store {
	t.Helper()
	s, err := Open(dir, append([]Option{WithMountDir(dir + ".mounts")}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unmountAll(t, s) })
	return s
}

func unmountAll(t *testing.T, s *Store) {
	ents, _ := os.ReadDir(s.mountDir)
	for _, e := range ents {
		mnt := filepath.Join(s.mountDir, e.Name())
		if isMounted(mnt) {
			if err := unmount(mnt); err != nil {
				t.Error(err)
			}
		}
	}
}

func writeFile(t *testing.T, path, content string, mode os.FileMode) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(content), mode); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(path, mode); err != nil {
		t.Fatal(err)
	}
}

// snapshot lists everything in the store (relative paths), to prove an
// operation changed nothing.
func snapshot(t *testing.T, s *Store) []string {
	t.Helper()
	var out []string
	err := filepath.WalkDir(s.Dir(), func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(s.Dir(), p)
		out = append(out, rel)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func tmpEntries(t *testing.T, s *Store) []string {
	t.Helper()
	ents, err := os.ReadDir(s.path("tmp"))
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range ents {
		out = append(out, e.Name())
	}
	return out
}

func contentDirs(t *testing.T, s *Store) []string {
	t.Helper()
	ents, err := os.ReadDir(s.path("layers"))
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range ents {
		out = append(out, e.Name())
	}
	return out
}

func TestNormalizeName(t *testing.T) {
	valid := map[string]string{
		"root/busybox":         "root/busybox:latest",
		"root/busybox:latest":  "root/busybox:latest",
		"root/py:3.11":         "root/py:3.11",
		"a":                    "a:latest",
		"my-org/img_1.2:Tag-9": "my-org/img_1.2:Tag-9",
	}
	for in, want := range valid {
		got, err := NormalizeName(in)
		if err != nil || got != want {
			t.Errorf("NormalizeName(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
	for _, in := range []string{"", "Root/py", "/abs", "-x", "a//b", "a/../b", "a/./b", "a/", "a:b:c", "a:", "a b", "a:tag/x", "é", strings.Repeat("a", 201)} {
		_, err := NormalizeName(in)
		if !errdefs.IsInvalidArgument(err) {
			t.Errorf("NormalizeName(%q) err = %v; want invalid argument", in, err)
			continue
		}
		var fe *errdefs.FieldError
		if !errors.As(err, &fe) || fe.Field != "image" {
			t.Errorf("NormalizeName(%q) err = %v; want a field error on image", in, err)
		}
	}
}

func TestImportDirPreservesTree(t *testing.T) {
	ctx := t.Context()
	src := t.TempDir()
	writeFile(t, filepath.Join(src, "bin/tool"), "#!/bin/sh\necho hi\n", 0o755)
	writeFile(t, filepath.Join(src, "etc/secret"), "s3cret", 0o600)
	writeFile(t, filepath.Join(src, "usr/bin/su"), "suid", os.ModeSetuid|0o755)
	if err := os.Symlink("/bin/tool", filepath.Join(src, "bin/link")); err != nil {
		t.Fatal(err)
	}
	if err := os.Link(filepath.Join(src, "bin/tool"), filepath.Join(src, "bin/hard")); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mkfifo(filepath.Join(src, "fifo"), 0o640); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(filepath.Join(src, "tmp"), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(filepath.Join(src, "tmp"), os.ModeSticky|0o777); err != nil {
		t.Fatal(err)
	}
	haveXattr := unix.Lsetxattr(filepath.Join(src, "etc/secret"), "user.opendsec", []byte("v1"), 0) == nil
	mtime := time.Date(2020, 1, 2, 3, 4, 5, 0, time.UTC)
	if err := os.Chtimes(filepath.Join(src, "etc/secret"), mtime, mtime); err != nil {
		t.Fatal(err)
	}
	if isRoot {
		if err := os.Lchown(filepath.Join(src, "etc/secret"), 1000, 1001); err != nil {
			t.Fatal(err)
		}
		if err := unix.Mknod(filepath.Join(src, "null"), unix.S_IFCHR|0o666, int(unix.Mkdev(1, 3))); err != nil {
			t.Fatal(err)
		}
	}

	s := newStore(t)
	var reports []Progress
	cfg := Config{Env: []string{"PATH=/bin", "A=b=c"}, Workdir: "/home/user", User: "user", Entrypoint: []string{"/bin/sh"}, Labels: map[string]string{"k": "v"}}
	img, err := s.ImportDir(ctx, "test/tree", src, cfg, WithProgress(func(p Progress) { reports = append(reports, p) }))
	if err != nil {
		t.Fatal(err)
	}
	if img.Name != "test/tree:latest" || !strings.HasPrefix(img.ID, "sha256:") || img.Size == 0 {
		t.Fatalf("image = %+v", img)
	}
	if len(reports) == 0 || !reports[len(reports)-1].Done || reports[len(reports)-1].Files < 8 || reports[len(reports)-1].TotalBytes == 0 {
		t.Fatalf("progress reports = %+v", reports)
	}

	ri, err := s.Get(ctx, "test/tree")
	if err != nil {
		t.Fatal(err)
	}
	if len(heldDirs(t, ri, "")) != 1 || ri.Workdir != "/home/user" || ri.User != "user" || !slices.Equal(ri.Env, cfg.Env) || ri.Rootfs.Image != "test/tree:latest" {
		t.Fatalf("runtime image = %+v", ri)
	}
	root := heldDirs(t, ri, "")[0]
	check := func(rel string, wantMode os.FileMode) fs.FileInfo {
		t.Helper()
		fi, err := os.Lstat(filepath.Join(root, rel))
		if err != nil {
			t.Fatal(err)
		}
		if got := fi.Mode() & (os.ModePerm | os.ModeSetuid | os.ModeSticky | os.ModeType); got != wantMode {
			t.Errorf("%s mode = %v; want %v", rel, got, wantMode)
		}
		return fi
	}
	check("bin/tool", 0o755)
	check("usr/bin/su", os.ModeSetuid|0o755)
	check("tmp", os.ModeDir|os.ModeSticky|0o777)
	check("fifo", os.ModeNamedPipe|0o640)
	sec := check("etc/secret", 0o600)
	if !sec.ModTime().Equal(mtime) {
		t.Errorf("mtime = %v; want %v", sec.ModTime(), mtime)
	}
	if b, _ := os.ReadFile(filepath.Join(root, "etc/secret")); string(b) != "s3cret" {
		t.Errorf("content = %q", b)
	}
	if l, err := os.Readlink(filepath.Join(root, "bin/link")); err != nil || l != "/bin/tool" {
		t.Errorf("symlink = %q, %v", l, err)
	}
	a, _ := os.Stat(filepath.Join(root, "bin/tool"))
	b, _ := os.Stat(filepath.Join(root, "bin/hard"))
	if !os.SameFile(a, b) {
		t.Error("hard link was copied as two files")
	}
	if haveXattr {
		v := make([]byte, 16)
		n, err := unix.Lgetxattr(filepath.Join(root, "etc/secret"), "user.opendsec", v)
		if err != nil || string(v[:n]) != "v1" {
			t.Errorf("xattr = %q, %v", v[:n], err)
		}
	}
	if isRoot {
		st := sec.Sys().(*syscall.Stat_t)
		if st.Uid != 1000 || st.Gid != 1001 {
			t.Errorf("owner = %d:%d; want 1000:1001", st.Uid, st.Gid)
		}
		if _, err := os.Lstat(filepath.Join(root, "null")); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("device file copied: %v", err)
		}
	}
	if tmp := tmpEntries(t, s); len(tmp) != 0 {
		t.Errorf("tmp left behind: %v", tmp)
	}

	// Same tree again: same digest, no second copy.
	img2, err := s.ImportDir(ctx, "test/tree:v2", src, Config{})
	if err != nil {
		t.Fatal(err)
	}
	// Same tree, other config: another image ID, the same single layer.
	if img2.ID == img.ID || img2.Layers[0].Digest != img.Layers[0].Digest || len(contentDirs(t, s)) != 1 {
		t.Errorf("identical import: id %s vs %s, layers %v vs %v, layer dirs %v", img2.ID, img.ID, img2.Layers, img.Layers, contentDirs(t, s))
	}
	list, err := s.List(ctx)
	if err != nil || len(list) != 2 || list[0].Name != "test/tree:latest" || list[1].Name != "test/tree:v2" || list[0].Config.Labels["k"] != "v" {
		t.Fatalf("List = %+v, %v", list, err)
	}
}

func TestImportDirBadInput(t *testing.T) {
	ctx := t.Context()
	s := newStore(t)
	src := t.TempDir()
	writeFile(t, filepath.Join(src, "f"), "x", 0o644)
	before := snapshot(t, s)
	cases := []struct {
		name, src, field string
		cfg              Config
	}{
		{"root/x", filepath.Join(src, "missing"), "rootfs", Config{}},
		{"root/x", filepath.Join(src, "f"), "rootfs", Config{}},
		{"root/x", "", "rootfs", Config{}},
		{"root/x", s.Dir(), "rootfs", Config{}},
		{"Bad Name", src, "image", Config{}},
		{"root/x", src, "env", Config{Env: []string{"NOEQUALS"}}},
		{"root/x", src, "workdir", Config{Workdir: "rel"}},
	}
	for _, c := range cases {
		_, err := s.ImportDir(ctx, c.name, c.src, c.cfg)
		var fe *errdefs.FieldError
		if !errors.As(err, &fe) || fe.Field != c.field {
			t.Errorf("ImportDir(%q, %q) err = %v; want field error on %s", c.name, c.src, err, c.field)
		}
	}
	if after := snapshot(t, s); !slices.Equal(before, after) {
		t.Errorf("store changed by bad input:\nbefore %v\nafter  %v", before, after)
	}
}

type tarEntry struct {
	hdr  tar.Header
	body string
}

func makeTar(t *testing.T, gz bool, entries []tarEntry) string {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range entries {
		h := e.hdr
		if h.Typeflag == tar.TypeReg {
			h.Size = int64(len(e.body))
		}
		if h.Mode == 0 {
			h.Mode = 0o644
		}
		if h.ModTime.IsZero() {
			h.ModTime = time.Unix(1700000000, 0)
		}
		if err := tw.WriteHeader(&h); err != nil {
			t.Fatal(err)
		}
		if e.body != "" {
			tw.Write([]byte(e.body))
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	data := buf.Bytes()
	name := "img.tar"
	if gz {
		var zb bytes.Buffer
		zw := gzip.NewWriter(&zb)
		zw.Write(data)
		zw.Close()
		data = zb.Bytes()
		name = "img.tar.gz"
	}
	p := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(p, data, 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestImportTar(t *testing.T) {
	entries := []tarEntry{
		{hdr: tar.Header{Name: "./", Typeflag: tar.TypeDir, Mode: 0o755}},
		{hdr: tar.Header{Name: "./bin/", Typeflag: tar.TypeDir, Mode: 0o755}},
		{hdr: tar.Header{Name: "./bin/busybox", Typeflag: tar.TypeReg, Mode: 0o4755}, body: "elf"},
		{hdr: tar.Header{Name: "./bin/sh", Typeflag: tar.TypeSymlink, Linkname: "/bin/busybox"}},
		{hdr: tar.Header{Name: "./bin/ash", Typeflag: tar.TypeLink, Linkname: "./bin/busybox"}},
		{hdr: tar.Header{Name: "home/user/.profile", Typeflag: tar.TypeReg, Mode: 0o640, Uid: 1000, Gid: 1000}, body: "export A=1\n"},
		{hdr: tar.Header{Name: "./dev/null", Typeflag: tar.TypeChar, Devmajor: 1, Devminor: 3, Mode: 0o666}},
		{hdr: tar.Header{Name: "./run/fifo", Typeflag: tar.TypeFifo, Mode: 0o600}},
	}
	for _, gz := range []bool{false, true} {
		t.Run(fmt.Sprintf("gzip=%v", gz), func(t *testing.T) {
			ctx := t.Context()
			s := newStore(t)
			img, err := s.ImportTar(ctx, "tar/img:1", makeTar(t, gz, entries), Config{User: "user"})
			if err != nil {
				t.Fatal(err)
			}
			ri, err := s.Get(ctx, "tar/img:1")
			if err != nil {
				t.Fatal(err)
			}
			root := heldDirs(t, ri, "")[0]
			if b, _ := os.ReadFile(filepath.Join(root, "bin/busybox")); string(b) != "elf" {
				t.Errorf("busybox content = %q", b)
			}
			fi, err := os.Lstat(filepath.Join(root, "bin/busybox"))
			if err != nil || fi.Mode()&(os.ModePerm|os.ModeSetuid) != os.ModeSetuid|0o755 {
				t.Errorf("busybox mode = %v, %v", fi.Mode(), err)
			}
			if l, _ := os.Readlink(filepath.Join(root, "bin/sh")); l != "/bin/busybox" {
				t.Errorf("symlink = %q", l)
			}
			a, _ := os.Stat(filepath.Join(root, "bin/ash"))
			if !os.SameFile(a, fi) {
				t.Error("hard link not preserved")
			}
			if _, err := os.Lstat(filepath.Join(root, "dev/null")); !errors.Is(err, fs.ErrNotExist) {
				t.Errorf("device extracted: %v", err)
			}
			if fi, err := os.Lstat(filepath.Join(root, "run/fifo")); err != nil || fi.Mode()&os.ModeNamedPipe == 0 {
				t.Errorf("fifo = %v, %v", fi, err)
			}
			prof, err := os.Lstat(filepath.Join(root, "home/user/.profile"))
			if err != nil || prof.Mode().Perm() != 0o640 {
				t.Fatalf("profile = %v, %v", prof, err)
			}
			if isRoot {
				if st := prof.Sys().(*syscall.Stat_t); st.Uid != 1000 || st.Gid != 1000 {
					t.Errorf("owner = %d:%d", st.Uid, st.Gid)
				}
			}
			if img.Size != int64(len("elf")+len("export A=1\n")) {
				t.Errorf("size = %d", img.Size)
			}
			if tmp := tmpEntries(t, s); len(tmp) != 0 {
				t.Errorf("tmp left behind: %v", tmp)
			}
		})
	}
}

func TestImportTarRefusesEscapes(t *testing.T) {
	outside := t.TempDir()
	cases := map[string][]tarEntry{
		"dotdot": {
			{hdr: tar.Header{Name: "../evil", Typeflag: tar.TypeReg}, body: "x"},
		},
		"nested dotdot": {
			{hdr: tar.Header{Name: "a/", Typeflag: tar.TypeDir, Mode: 0o755}},
			{hdr: tar.Header{Name: "a/../../evil", Typeflag: tar.TypeReg}, body: "x"},
		},
		"absolute": {
			{hdr: tar.Header{Name: filepath.Join(outside, "evil"), Typeflag: tar.TypeReg}, body: "x"},
		},
		"absolute symlink then write through it": {
			{hdr: tar.Header{Name: "ok", Typeflag: tar.TypeReg}, body: "fine"},
			{hdr: tar.Header{Name: "lnk", Typeflag: tar.TypeSymlink, Linkname: outside}},
			{hdr: tar.Header{Name: "lnk/evil", Typeflag: tar.TypeReg}, body: "x"},
		},
		"relative symlink escape": {
			{hdr: tar.Header{Name: "up", Typeflag: tar.TypeSymlink, Linkname: "../../../../../../../../.." + outside}},
			{hdr: tar.Header{Name: "up/evil", Typeflag: tar.TypeReg}, body: "x"},
		},
		"hard link to outside": {
			{hdr: tar.Header{Name: "h", Typeflag: tar.TypeLink, Linkname: "../../../../etc/passwd"}},
		},
		"hard link through symlink": {
			{hdr: tar.Header{Name: "lnk", Typeflag: tar.TypeSymlink, Linkname: "/etc"}},
			{hdr: tar.Header{Name: "h", Typeflag: tar.TypeLink, Linkname: "lnk/passwd"}},
		},
	}
	s := newStore(t)
	ctx := t.Context()
	if _, err := s.ImportDir(ctx, "keep/me", func() string {
		d := t.TempDir()
		writeFile(t, filepath.Join(d, "f"), "keep", 0o644)
		return d
	}(), Config{}); err != nil {
		t.Fatal(err)
	}
	before := snapshot(t, s)
	for name, entries := range cases {
		t.Run(name, func(t *testing.T) {
			_, err := s.ImportTar(ctx, "keep/me", makeTar(t, false, entries), Config{})
			if !errdefs.IsInvalidArgument(err) {
				t.Fatalf("err = %v; want invalid argument", err)
			}
			if after := snapshot(t, s); !slices.Equal(before, after) {
				t.Errorf("store changed:\nbefore %v\nafter  %v", before, after)
			}
			if _, err := os.Lstat(filepath.Join(outside, "evil")); !errors.Is(err, fs.ErrNotExist) {
				t.Errorf("file written outside the root: %v", err)
			}
			ri, err := s.Get(ctx, "keep/me")
			if err != nil {
				t.Fatal(err)
			}
			if b, _ := os.ReadFile(filepath.Join(heldDirs(t, ri, "")[0], "f")); string(b) != "keep" {
				t.Errorf("existing image content = %q", b)
			}
		})
	}
}

func TestImportTarBadFiles(t *testing.T) {
	ctx := t.Context()
	s := newStore(t)
	dir := t.TempDir()
	empty := filepath.Join(dir, "empty.tar")
	os.WriteFile(empty, nil, 0o644)
	garbage := filepath.Join(dir, "garbage.tar")
	os.WriteFile(garbage, bytes.Repeat([]byte("not a tar "), 200), 0o644)
	zeros := filepath.Join(dir, "zeros.tar")
	os.WriteFile(zeros, make([]byte, 1024), 0o644)
	xz := filepath.Join(dir, "img.tar.xz")
	os.WriteFile(xz, []byte{0xfd, '7', 'z', 'X', 'Z', 0, 1, 2}, 0o644)
	before := snapshot(t, s)
	for path, want := range map[string]string{
		empty:                        "empty (0 bytes)",
		garbage:                      "not a valid tarball",
		zeros:                        "no entries",
		xz:                           "xz-compressed",
		filepath.Join(dir, "nofile"): "no such file",
		dir:                          "not a regular file",
	} {
		_, err := s.ImportTar(ctx, "bad/tar", path, Config{})
		var fe *errdefs.FieldError
		if !errors.As(err, &fe) || fe.Field != "tar" || !strings.Contains(err.Error(), want) {
			t.Errorf("ImportTar(%s) err = %v; want field error on tar containing %q", filepath.Base(path), err, want)
		}
	}
	if after := snapshot(t, s); !slices.Equal(before, after) {
		t.Errorf("store changed:\nbefore %v\nafter  %v", before, after)
	}
}

func TestGetNotFound(t *testing.T) {
	ctx := t.Context()
	s := newStore(t)
	_, err := s.Get(ctx, "root/py:3.11")
	if !errdefs.IsNotFound(err) || !strings.Contains(err.Error(), "none yet") || !strings.Contains(err.Error(), "import-rootfs") {
		t.Fatalf("empty store: err = %v", err)
	}
	src := t.TempDir()
	writeFile(t, filepath.Join(src, "f"), "x", 0o644)
	for _, n := range []string{"root/busybox", "zz/other:1"} {
		if _, err := s.ImportDir(ctx, n, src, Config{}); err != nil {
			t.Fatal(err)
		}
	}
	_, err = s.Get(ctx, "root/py:3.11")
	if !errdefs.IsNotFound(err) || !strings.Contains(err.Error(), "root/busybox:latest, zz/other:1") || !strings.Contains(err.Error(), "build.sh") {
		t.Fatalf("err = %v", err)
	}
	if _, err := s.Get(ctx, "root/busybox:latest"); err != nil {
		t.Fatalf("default tag: %v", err)
	}
	if err := s.Remove(ctx, "root/busybox"); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Get(ctx, "root/busybox"); !errdefs.IsNotFound(err) {
		t.Fatalf("after remove: %v", err)
	}
	if err := s.Remove(ctx, "root/busybox"); !errdefs.IsNotFound(err) {
		t.Fatalf("second remove: %v", err)
	}
	if _, err := s.Get(ctx, "BAD"); !errdefs.IsInvalidArgument(err) {
		t.Fatalf("bad name: %v", err)
	}
}

func TestReimportKeepsHeldContent(t *testing.T) {
	ctx := t.Context()
	s := newStore(t)
	v1, v2 := t.TempDir(), t.TempDir()
	writeFile(t, filepath.Join(v1, "version"), "1", 0o644)
	writeFile(t, filepath.Join(v2, "version"), "2", 0o644)
	if _, err := s.ImportDir(ctx, "app", v1, Config{}); err != nil {
		t.Fatal(err)
	}
	held, err := s.Hold(ctx, "app", "sbx1")
	if err != nil {
		t.Fatal(err)
	}
	plain, err := s.Get(ctx, "app") // a holder that did not Hold
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.ImportDir(ctx, "app", v2, Config{}); err != nil {
		t.Fatal(err)
	}
	now, err := s.Get(ctx, "app")
	if err != nil {
		t.Fatal(err)
	}
	if heldDirs(t, now, "")[0] == heldDirs(t, held, "sbx1")[0] {
		t.Fatal("re-import did not change the content")
	}
	read := func(layer string) string {
		b, err := os.ReadFile(filepath.Join(layer, "version"))
		if err != nil {
			return err.Error()
		}
		return string(b)
	}
	if read(heldDirs(t, now, "")[0]) != "2" || read(heldDirs(t, held, "sbx1")[0]) != "1" || read(heldDirs(t, plain, "")[0]) != "1" {
		t.Fatalf("now=%s held=%s plain=%s", read(heldDirs(t, now, "")[0]), read(heldDirs(t, held, "sbx1")[0]), read(heldDirs(t, plain, "")[0]))
	}
	res, err := s.Prune(ctx)
	if err != nil || len(res.Removed) != 0 {
		t.Fatalf("prune while held = %+v, %v", res, err)
	}
	if read(heldDirs(t, held, "sbx1")[0]) != "1" {
		t.Fatal("held content pruned")
	}
	if err := s.Release(ctx, "sbx1"); err != nil {
		t.Fatal(err)
	}
	res, err = s.Prune(ctx)
	if err != nil || len(res.Removed) != 1 || res.Bytes != 1 {
		t.Fatalf("prune after release = %+v, %v", res, err)
	}
	if _, err := os.Stat(held.Rootfs.Layers[0].Path); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("released content still there: %v", err)
	}
	if read(heldDirs(t, now, "")[0]) != "2" {
		t.Error("current content pruned")
	}
	if _, err := s.Hold(ctx, "app", "bad holder"); !errdefs.IsInvalidArgument(err) {
		t.Errorf("bad holder: %v", err)
	}
}

func checkOneValidRef(t *testing.T, s *Store, name string, srcs map[string]bool) {
	t.Helper()
	ri, err := s.Get(t.Context(), name)
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(filepath.Join(heldDirs(t, ri, "")[0], "who"))
	if err != nil || !srcs[string(b)] {
		t.Fatalf("ref points at %q, %v", b, err)
	}
	imgs, err := s.List(t.Context())
	if err != nil || len(imgs) != 1 {
		t.Fatalf("List = %v, %v", imgs, err)
	}
	if tmp := tmpEntries(t, s); len(tmp) != 0 {
		t.Fatalf("tmp left behind: %v", tmp)
	}
	refs, _ := os.ReadDir(s.path("refs"))
	if len(refs) != 1 {
		t.Fatalf("refs dir = %v", refs)
	}
}

func TestConcurrentImportsGoroutines(t *testing.T) {
	s := newStore(t)
	const n = 6
	srcs := map[string]bool{}
	dirs := make([]string, n)
	for i := range n {
		dirs[i] = t.TempDir()
		who := fmt.Sprint(i % 3) // some identical trees race on the same content dir
		writeFile(t, filepath.Join(dirs[i], "who"), who, 0o644)
		os.Chtimes(filepath.Join(dirs[i], "who"), time.Unix(1, 0), time.Unix(1, 0))
		os.Chtimes(dirs[i], time.Unix(1, 0), time.Unix(1, 0))
		srcs[who] = true
	}
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i := range n {
		wg.Go(func() {
			// Each goroutine opens its own Store, as separate components would.
			st, err := Open(s.Dir(), WithMountDir(s.mountDir))
			if err == nil {
				_, err = st.ImportDir(t.Context(), "race/img", dirs[i], Config{})
			}
			errs[i] = err
		})
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	checkOneValidRef(t, s, "race/img", srcs)
	if c := contentDirs(t, s); len(c) != 3 {
		t.Errorf("content dirs = %v; want 3 (identical trees share one)", c)
	}
}

func TestConcurrentImportsProcesses(t *testing.T) {
	s := newStore(t)
	srcs := map[string]bool{}
	var cmds []*exec.Cmd
	var outs []*bytes.Buffer
	for i := range 2 {
		d := t.TempDir()
		// Enough files that the two imports overlap.
		for j := range 300 {
			writeFile(t, filepath.Join(d, "files", fmt.Sprint(j)), strings.Repeat("x", 1000), 0o644)
		}
		writeFile(t, filepath.Join(d, "who"), fmt.Sprint(i), 0o644)
		srcs[fmt.Sprint(i)] = true
		cmd := exec.CommandContext(t.Context(), os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), helperEnv+"="+s.Dir()+"|proc/img|"+d)
		var out bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &out
		cmds = append(cmds, cmd)
		outs = append(outs, &out)
	}
	for _, c := range cmds {
		if err := c.Start(); err != nil {
			t.Fatal(err)
		}
	}
	for i, c := range cmds {
		if err := c.Wait(); err != nil {
			t.Fatalf("importer %d: %v: %s", i, err, outs[i])
		}
	}
	checkOneValidRef(t, s, "proc/img", srcs)
	if c := contentDirs(t, s); len(c) != 2 {
		t.Errorf("content dirs = %v; want 2", c)
	}
}

func TestOpenCleansCrashedImports(t *testing.T) {
	s := newStore(t)
	// A crashed importer: staging dir and lock file, lock not held.
	os.MkdirAll(s.path("tmp", "deadbeef", "etc"), 0o755)
	os.WriteFile(s.path("tmp", "deadbeef.lock"), nil, 0o600)
	os.MkdirAll(s.path("tmp", "nolock"), 0o755)
	// A live importer in this process: its staging must survive.
	live, err := s.newStaging()
	if err != nil {
		t.Fatal(err)
	}
	defer live.cleanup()
	if _, err := Open(s.Dir(), WithMountDir(s.mountDir)); err != nil {
		t.Fatal(err)
	}
	got := tmpEntries(t, s)
	want := []string{filepath.Base(live.dir), filepath.Base(live.dir) + ".lock"}
	slices.Sort(got)
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Fatalf("tmp = %v; want %v", got, want)
	}
}

func TestLockHonoursContext(t *testing.T) {
	s := newStore(t)
	unlock, err := s.lock(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	defer unlock()
	ctx, cancel := context.WithTimeout(t.Context(), 50*time.Millisecond)
	defer cancel()
	if err := s.Remove(ctx, "x"); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Remove under a held lock = %v; want deadline exceeded", err)
	}
}

// cachedRootfs returns build.sh's cache dir for name, skipping when absent.
func cachedRootfs(t *testing.T, name string) string {
	t.Helper()
	cache := os.Getenv("OPENDSEC_CACHE")
	if cache == "" {
		cache = "/var/cache/opendsec"
	}
	dir := filepath.Join(cache, "rootfs", name)
	if _, err := os.Stat(dir + ".stamp"); err != nil {
		t.Skipf("no %s base rootfs cached at %s: run deploy/images/build.sh --no-import first", name, dir)
	}
	return dir
}

func TestBaseImagesFromBuildCache(t *testing.T) {
	// A real root filesystem has root-only files and owners to preserve.
	testutil.RequiresRoot(t)
	for _, c := range []struct {
		dir, name string
		cmd       []string
		want      string
	}{
		{"busybox", "root/busybox", []string{"/bin/sh", "-c", "echo $((6*7)); id -u user"}, "42\n1000\n"},
		{"py-3.11", "root/py:3.11", []string{"/usr/bin/python3", "-c", "import sys; print(6*7, sys.version_info[:2] == (3, 11))"}, "42 True\n"},
	} {
		t.Run(c.dir, func(t *testing.T) {
			src := cachedRootfs(t, c.dir)
			s := newStore(t)
			start := time.Now()
			img, err := s.ImportDir(t.Context(), c.name, src, Config{Workdir: "/home/user", User: "user"})
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("imported %s: %d bytes in %v", img.Name, img.Size, time.Since(start).Round(time.Millisecond))
			ri, err := s.Get(t.Context(), c.name)
			if err != nil {
				t.Fatal(err)
			}
			fi, err := os.Stat(filepath.Join(heldDirs(t, ri, "")[0], "home/user"))
			if err != nil || fi.Sys().(*syscall.Stat_t).Uid != 1000 {
				t.Fatalf("home/user = %v, %v", fi, err)
			}
			cmd := exec.CommandContext(t.Context(), c.cmd[0], c.cmd[1:]...)
			cmd.SysProcAttr = &syscall.SysProcAttr{Chroot: heldDirs(t, ri, "")[0]}
			cmd.Dir = "/"
			cmd.Env = []string{"PATH=/usr/bin:/bin"}
			out, err := cmd.CombinedOutput()
			if err != nil || string(out) != c.want {
				t.Fatalf("chroot run = %q, %v; want %q", out, err, c.want)
			}
		})
	}
}

func TestImportCanceledLeavesNothing(t *testing.T) {
	s := newStore(t)
	src := t.TempDir()
	for j := range 500 {
		writeFile(t, filepath.Join(src, "d", fmt.Sprint(j)), "x", 0o644)
	}
	before := snapshot(t, s)
	ctx, cancel := context.WithCancel(t.Context())
	calls := 0
	_, err := s.ImportDir(ctx, "cancel/me", src, Config{}, WithProgress(func(p Progress) {
		if calls++; calls == 1 {
			cancel() // mid-copy
		}
	}))
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("err = %v; want context.Canceled", err)
	}
	if after := snapshot(t, s); !slices.Equal(before, after) {
		t.Errorf("store changed:\nbefore %v\nafter  %v", before, after)
	}
}

// heldDirs mounts ri's layers for holder (as a backend would) and returns
// them as directories, topmost first.
func heldDirs(t testing.TB, ri runtime.Image, holder string) []string {
	t.Helper()
	dirs, err := ri.Rootfs.Dirs(context.Background(), holder)
	if err != nil {
		t.Fatalf("mount layers of %s: %v", ri.Rootfs.Image, err)
	}
	return dirs
}

// A hold is a hard link to the image's hold template (no new inode per
// sandbox); the template outlives releases and goes with the image's
// manifest at prune.
func TestHoldIsALinkToTheTemplate(t *testing.T) {
	ctx := t.Context()
	s := newStore(t)
	src := t.TempDir()
	writeFile(t, filepath.Join(src, "version"), "1", 0o644)
	img, err := s.ImportDir(ctx, "app", src, Config{})
	if err != nil {
		t.Fatal(err)
	}
	h, err := digestHex(img.ID)
	if err != nil {
		t.Fatal(err)
	}
	for _, holder := range []string{"sbx1", "sbx2", "sbx1"} {
		if _, err := s.Hold(ctx, "app", holder); err != nil {
			t.Fatalf("hold %s: %v", holder, err)
		}
	}
	tmpl, err := os.Stat(s.path("holdnames", h))
	if err != nil {
		t.Fatal(err)
	}
	for _, holder := range []string{"sbx1", "sbx2"} {
		fi, err := os.Stat(s.path("holds", h, holder))
		if err != nil {
			t.Fatal(err)
		}
		if !os.SameFile(fi, tmpl) {
			t.Errorf("hold %s is not a link to the template", holder)
		}
		if b, err := os.ReadFile(s.path("holds", h, holder)); err != nil || string(b) != img.Name+"\n" {
			t.Errorf("hold %s says %q, %v; want the image's name", holder, b, err)
		}
	}
	for _, holder := range []string{"sbx1", "sbx2"} {
		if err := s.Release(ctx, holder); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := os.Stat(s.path("holds", h)); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("hold dir after the last release: %v", err)
	}
	if _, err := os.Stat(s.path("holdnames", h)); err != nil {
		t.Fatalf("template after release: %v; want it kept for the next hold", err)
	}
	if err := s.Remove(ctx, "app"); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Prune(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(s.path("holdnames", h)); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("template after the image was pruned: %v", err)
	}
}
