package agent

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"encoding/json"
	"fmt"
	"io"
	"mime/multipart"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	fspb "github.com/kernflux/opendsec/api/gen/filesystem"
)

func (e *env) do(t *testing.T, method, rawURL string, body io.Reader, hdr map[string]string) (*http.Response, []byte) {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), method, rawURL, body)
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	resp, err := e.http.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp, b
}

func filesURL(path string, extra ...string) string {
	v := url.Values{"path": {path}}
	for i := 0; i+1 < len(extra); i += 2 {
		v.Set(extra[i], extra[i+1])
	}
	return base + "/files?" + v.Encode()
}

func dirEntries(t *testing.T, dir string) []string {
	t.Helper()
	var out []string
	filepath.Walk(dir, func(p string, info os.FileInfo, err error) error {
		if p != dir {
			out = append(out, strings.TrimPrefix(p, dir))
		}
		return nil
	})
	return out
}

func TestFilesWriteRead(t *testing.T) {
	e := newEnv(t, Config{})
	dir := t.TempDir()

	// octet-stream, creating parents.
	target := filepath.Join(dir, "a", "b", "hello.txt")
	resp, b := e.do(t, "POST", filesURL(target), strings.NewReader("hello"), map[string]string{
		"Content-Type": "application/octet-stream", "X-Metadata-Owner-Team": "rl",
	})
	if resp.StatusCode != 200 {
		t.Fatalf("upload: %s %s", resp.Status, b)
	}
	var res []uploadResult
	if err := json.Unmarshal(b, &res); err != nil || len(res) != 1 || res[0].Path != target || res[0].Name != "hello.txt" || res[0].Type != "file" {
		t.Fatalf("upload result %s (%v)", b, err)
	}
	if st, _ := os.Stat(target); st == nil || st.Mode().Perm() != 0o644 {
		t.Fatalf("mode of uploaded file: %v", st)
	}

	// read back plain, then gzip.
	resp, b = e.do(t, "GET", filesURL(target), nil, nil)
	if resp.StatusCode != 200 || string(b) != "hello" || resp.Header.Get("Content-Length") != "5" ||
		!strings.Contains(resp.Header.Get("Content-Disposition"), "hello.txt") {
		t.Fatalf("read: %s %q %v", resp.Status, b, resp.Header)
	}
	resp, b = e.do(t, "GET", filesURL(target), nil, map[string]string{"Accept-Encoding": "gzip"})
	if resp.Header.Get("Content-Encoding") != "gzip" {
		t.Fatalf("no gzip: %v", resp.Header)
	}
	zr, err := gzip.NewReader(bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	if plain, _ := io.ReadAll(zr); string(plain) != "hello" {
		t.Fatalf("gunzipped %q", plain)
	}
	resp, _ = e.do(t, "GET", filesURL(target), nil, map[string]string{"Accept-Encoding": "br, identity;q=0"})
	if resp.StatusCode != 406 {
		t.Fatalf("unsupported encoding: %s", resp.Status)
	}

	// Files whose size stat does not report (/proc seq files cannot seek
	// to their end) are read whole; an empty file is empty.
	resp, b = e.do(t, "GET", filesURL("/proc/self/mounts"), nil, nil)
	if resp.StatusCode != 200 || !strings.Contains(string(b), " / ") {
		t.Fatalf("read /proc/self/mounts: %s %q", resp.Status, b)
	}
	resp, b = e.do(t, "GET", filesURL("/proc/self/status"), nil, nil)
	if resp.StatusCode != 200 || !strings.Contains(string(b), "Name:") {
		t.Fatalf("read /proc/self/status: %s %q", resp.Status, b)
	}
	empty := filepath.Join(dir, "empty")
	if err := os.WriteFile(empty, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if resp, b = e.do(t, "GET", filesURL(empty), nil, nil); resp.StatusCode != 200 || len(b) != 0 {
		t.Fatalf("read empty: %s %q", resp.Status, b)
	}

	// relative path resolves under the user's home (root → /root), ranged read.
	resp, b = e.do(t, "GET", filesURL(target), nil, map[string]string{"Range": "bytes=1-3"})
	if resp.StatusCode != 206 || string(b) != "ell" {
		t.Fatalf("range: %s %q", resp.Status, b)
	}

	// gzip request body.
	var zbuf bytes.Buffer
	zw := gzip.NewWriter(&zbuf)
	zw.Write([]byte("compressed body"))
	zw.Close()
	gzTarget := filepath.Join(dir, "gz.txt")
	resp, b = e.do(t, "POST", filesURL(gzTarget), &zbuf, map[string]string{"Content-Type": "application/octet-stream", "Content-Encoding": "gzip"})
	if got, _ := os.ReadFile(gzTarget); resp.StatusCode != 200 || string(got) != "compressed body" {
		t.Fatalf("gzip upload: %s %s %q", resp.Status, b, got)
	}

	// multipart with two parts whose filenames are full paths.
	var mp bytes.Buffer
	mw := multipart.NewWriter(&mp)
	one, two := filepath.Join(dir, "m", "one.txt"), filepath.Join(dir, "m", "two.txt")
	for _, p := range []string{one, two} {
		w, _ := mw.CreateFormFile("file", p)
		w.Write([]byte("content of " + filepath.Base(p)))
	}
	mw.Close()
	resp, b = e.do(t, "POST", base+"/files", &mp, map[string]string{"Content-Type": mw.FormDataContentType()})
	if resp.StatusCode != 200 {
		t.Fatalf("multipart: %s %s", resp.Status, b)
	}
	for _, p := range []string{one, two} {
		if got, _ := os.ReadFile(p); string(got) != "content of "+filepath.Base(p) {
			t.Fatalf("%s = %q", p, got)
		}
	}

	// overwrite truncates; empty file reads with Content-Length: 0.
	resp, _ = e.do(t, "POST", filesURL(target), strings.NewReader(""), map[string]string{"Content-Type": "application/octet-stream"})
	if resp.StatusCode != 200 {
		t.Fatal(resp.Status)
	}
	resp, b = e.do(t, "GET", filesURL(target), nil, map[string]string{"Accept-Encoding": "gzip"})
	if resp.StatusCode != 200 || len(b) != 0 || resp.Header.Get("Content-Length") != "0" {
		t.Fatalf("empty read: %s %q %v", resp.Status, b, resp.Header)
	}

	// metadata headers become xattrs reported by Stat (skip where the temp
	// filesystem has no user xattrs).
	mdTarget := filepath.Join(dir, "md.txt")
	resp, b = e.do(t, "POST", filesURL(mdTarget), strings.NewReader("x"), map[string]string{"Content-Type": "application/octet-stream", "X-Metadata-Kind": "result"})
	if resp.StatusCode == 200 {
		st, err := e.fs.Stat(t.Context(), connect.NewRequest(&fspb.StatRequest{Path: mdTarget}))
		if err != nil || st.Msg.Entry.Metadata["kind"] != "result" {
			t.Fatalf("metadata: %v %v", st, err)
		}
	} else if !strings.Contains(string(b), "metadata") {
		t.Fatalf("metadata upload: %s %s", resp.Status, b)
	}
}

func TestFilesErrors(t *testing.T) {
	e := newEnv(t, Config{MaxUploadBytes: 1 << 20})
	dir := t.TempDir()
	missing := filepath.Join(dir, "missing.txt")

	resp, b := e.do(t, "GET", filesURL(missing), nil, nil)
	if resp.StatusCode != 404 || string(b) != fmt.Sprintf(`{"code":404,"message":"path '%s' does not exist"}`, missing) {
		t.Fatalf("missing: %s %s", resp.Status, b)
	}
	resp, b = e.do(t, "GET", filesURL(dir), nil, nil)
	if resp.StatusCode != 400 || !strings.Contains(string(b), "is a directory") {
		t.Fatalf("dir: %s %s", resp.Status, b)
	}
	resp, b = e.do(t, "GET", base+"/files?path=%ff%fe", nil, nil)
	if resp.StatusCode != 400 || !strings.Contains(string(b), "path: is not valid UTF-8") {
		t.Fatalf("bad utf-8: %s %s", resp.Status, b)
	}
	resp, b = e.do(t, "GET", filesURL("/etc/hostname", "username", "no-such-user"), nil, nil)
	if resp.StatusCode != 401 || !strings.Contains(string(b), "invalid username") {
		t.Fatalf("unknown user: %s %s", resp.Status, b)
	}

	// Too large, by Content-Length and by streaming: 413, nothing left.
	up := filepath.Join(dir, "new", "big.bin")
	resp, b = e.do(t, "POST", filesURL(up), bytes.NewReader(make([]byte, 2<<20)), map[string]string{"Content-Type": "application/octet-stream"})
	if resp.StatusCode != 413 || !strings.Contains(string(b), "2097152") || !strings.Contains(string(b), "1048576") {
		t.Fatalf("too large: %s %s", resp.Status, b)
	}
	resp, b = e.do(t, "POST", filesURL(up), io.MultiReader(bytes.NewReader(make([]byte, 2<<20))), map[string]string{"Content-Type": "application/octet-stream", "Transfer-Encoding": "chunked"})
	if resp.StatusCode != 413 || !strings.Contains(string(b), "1048576") {
		t.Fatalf("too large streamed: %s %s", resp.Status, b)
	}
	if left := dirEntries(t, dir); len(left) != 0 {
		t.Fatalf("left behind: %v", left)
	}

	// Same target twice in one multipart: 400 and nothing written.
	var mp bytes.Buffer
	mw := multipart.NewWriter(&mp)
	for range 2 {
		w, _ := mw.CreateFormFile("file", filepath.Join(dir, "sub", "dup.txt"))
		w.Write([]byte("x"))
	}
	mw.Close()
	resp, b = e.do(t, "POST", base+"/files", &mp, map[string]string{"Content-Type": mw.FormDataContentType()})
	if resp.StatusCode != 400 || !strings.Contains(string(b), "more than one part") {
		t.Fatalf("duplicate: %s %s", resp.Status, b)
	}
	if left := dirEntries(t, dir); len(left) != 0 {
		t.Fatalf("left behind: %v", left)
	}
	// Missing path.
	resp, b = e.do(t, "POST", base+"/files", strings.NewReader("x"), map[string]string{"Content-Type": "application/octet-stream"})
	if resp.StatusCode != 400 || !strings.Contains(string(b), "path: missing") {
		t.Fatalf("no path: %s %s", resp.Status, b)
	}
}

func TestFilesAuth(t *testing.T) {
	const token = "secret-token"
	e := newEnv(t, Config{AccessToken: token})
	dir := t.TempDir()
	f := filepath.Join(dir, "f.txt")
	os.WriteFile(f, []byte("data"), 0o644)

	resp, _ := e.do(t, "GET", base+"/health", nil, nil)
	if resp.StatusCode != 204 {
		t.Fatalf("health: %s", resp.Status)
	}
	const unauth = `{"code":401,"message":"unauthorized access, please provide a valid access token or method signing if supported"}`
	resp, b := e.do(t, "POST", base+"/process.Process/List", strings.NewReader("{}"), map[string]string{"Content-Type": "application/json"})
	if resp.StatusCode != 401 || string(b) != unauth {
		t.Fatalf("rpc without token: %s %s", resp.Status, b)
	}
	resp, _ = e.do(t, "POST", base+"/process.Process/List", strings.NewReader("{}"), map[string]string{"Content-Type": "application/json", "X-Access-Token": token})
	if resp.StatusCode != 200 {
		t.Fatalf("rpc with token: %s", resp.Status)
	}
	resp, b = e.do(t, "GET", filesURL(f), nil, map[string]string{"X-Access-Token": "wrong"})
	if resp.StatusCode != 401 || string(b) != unauth {
		t.Fatalf("wrong token: %s %s", resp.Status, b)
	}
	resp, b = e.do(t, "GET", filesURL(f), nil, nil)
	if resp.StatusCode != 401 || !strings.Contains(string(b), "missing signature") {
		t.Fatalf("no signature: %s %s", resp.Status, b)
	}
	resp, b = e.do(t, "GET", filesURL(f, "signature", Signature(f, "read", "", token, "")), nil, nil)
	if resp.StatusCode != 200 || string(b) != "data" {
		t.Fatalf("signed read: %s %s", resp.Status, b)
	}
	// A read signature does not authorize a write.
	resp, b = e.do(t, "POST", filesURL(f, "signature", Signature(f, "read", "", token, "")), strings.NewReader("x"), map[string]string{"Content-Type": "application/octet-stream"})
	if resp.StatusCode != 401 || !strings.Contains(string(b), "invalid signature") {
		t.Fatalf("read sig for write: %s %s", resp.Status, b)
	}
	future := strconv.FormatInt(time.Now().Add(time.Minute).Unix(), 10)
	resp, _ = e.do(t, "POST", filesURL(f, "signature", Signature(f, "write", "root", token, future), "signature_expiration", future, "username", "root"), strings.NewReader("new"), map[string]string{"Content-Type": "application/octet-stream"})
	if got, _ := os.ReadFile(f); resp.StatusCode != 200 || string(got) != "new" {
		t.Fatalf("signed write: %s %q", resp.Status, got)
	}
	past := strconv.FormatInt(time.Now().Add(-time.Minute).Unix(), 10)
	resp, b = e.do(t, "GET", filesURL(f, "signature", Signature(f, "read", "", token, past), "signature_expiration", past), nil, nil)
	if resp.StatusCode != 401 || string(b) != `{"code":401,"message":"signature is already expired"}` {
		t.Fatalf("expired: %s %s", resp.Status, b)
	}
}

func TestFilesystemRPCs(t *testing.T) {
	e := newEnv(t, Config{})
	ctx := t.Context()
	dir := t.TempDir()

	// MakeDir with parents, then again → already_exists.
	deep := filepath.Join(dir, "x", "y")
	md, err := e.fs.MakeDir(ctx, connect.NewRequest(&fspb.MakeDirRequest{Path: deep}))
	if err != nil {
		t.Fatal(err)
	}
	if en := md.Msg.Entry; en.Type != fspb.FileType_FILE_TYPE_DIRECTORY || en.Path != deep || en.Mode != 0o755 || en.Permissions != "drwxr-xr-x" || en.Owner != "root" {
		t.Fatalf("MakeDir entry %v", en)
	}
	if _, err := e.fs.MakeDir(ctx, connect.NewRequest(&fspb.MakeDirRequest{Path: deep})); connect.CodeOf(err) != connect.CodeAlreadyExists {
		t.Fatalf("MakeDir twice: %v", err)
	}
	file := filepath.Join(dir, "x", "f.txt")
	os.WriteFile(file, []byte("four"), 0o644)
	if _, err := e.fs.MakeDir(ctx, connect.NewRequest(&fspb.MakeDirRequest{Path: file})); connect.CodeOf(err) != connect.CodeInvalidArgument {
		t.Fatalf("MakeDir on file: %v", err)
	}

	// Stat a file and a symlink to it.
	st, err := e.fs.Stat(ctx, connect.NewRequest(&fspb.StatRequest{Path: file}))
	if err != nil {
		t.Fatal(err)
	}
	if en := st.Msg.Entry; en.Name != "f.txt" || en.Type != fspb.FileType_FILE_TYPE_FILE || en.Size != 4 || en.Mode != 420 ||
		en.Permissions != "-rw-r--r--" || en.Owner != "root" || en.Group != "root" || en.ModifiedTime == nil {
		t.Fatalf("Stat %v", en)
	}
	link := filepath.Join(dir, "link")
	os.Symlink(file, link)
	st, err = e.fs.Stat(ctx, connect.NewRequest(&fspb.StatRequest{Path: link}))
	if err != nil {
		t.Fatal(err)
	}
	if en := st.Msg.Entry; en.GetSymlinkTarget() != file || en.Type != fspb.FileType_FILE_TYPE_FILE || !strings.HasPrefix(en.Permissions, "L") {
		t.Fatalf("Stat symlink %v", en)
	}
	if _, err := e.fs.Stat(ctx, connect.NewRequest(&fspb.StatRequest{Path: filepath.Join(dir, "nope")})); connect.CodeOf(err) != connect.CodeNotFound {
		t.Fatalf("Stat missing: %v", err)
	}
	// Invalid UTF-8 cannot be marshalled by clients; send the raw bytes.
	resp, b := e.do(t, "POST", base+"/filesystem.Filesystem/Stat", strings.NewReader("{\"path\":\"bad\xff\"}"), map[string]string{"Content-Type": "application/json"})
	if resp.StatusCode != 400 || !strings.Contains(string(b), "invalid_argument") || !strings.Contains(string(b), "invalid UTF-8") {
		t.Fatalf("Stat bad utf-8: %s %s", resp.Status, b)
	}

	// ListDir depth 1 and 2.
	names := func(depth uint32) []string {
		t.Helper()
		ls, err := e.fs.ListDir(ctx, connect.NewRequest(&fspb.ListDirRequest{Path: dir, Depth: depth}))
		if err != nil {
			t.Fatal(err)
		}
		var out []string
		for _, en := range ls.Msg.Entries {
			out = append(out, strings.TrimPrefix(en.Path, dir+"/"))
		}
		return out
	}
	if got := strings.Join(names(0), ","); got != "link,x" {
		t.Fatalf("depth 1: %s", got)
	}
	if got := strings.Join(names(2), ","); got != "link,x,x/f.txt,x/y" {
		t.Fatalf("depth 2: %s", got)
	}
	if _, err := e.fs.ListDir(ctx, connect.NewRequest(&fspb.ListDirRequest{Path: file})); connect.CodeOf(err) != connect.CodeInvalidArgument {
		t.Fatalf("ListDir on file: %v", err)
	}
	if _, err := e.fs.ListDir(ctx, connect.NewRequest(&fspb.ListDirRequest{Path: filepath.Join(dir, "nope")})); connect.CodeOf(err) != connect.CodeNotFound {
		t.Fatalf("ListDir missing: %v", err)
	}

	// Move creates the destination's parents.
	dst := filepath.Join(dir, "moved", "deeper", "g.txt")
	mv, err := e.fs.Move(ctx, connect.NewRequest(&fspb.MoveRequest{Source: file, Destination: dst}))
	if err != nil {
		t.Fatal(err)
	}
	if mv.Msg.Entry.Path != dst || mv.Msg.Entry.Size != 4 {
		t.Fatalf("Move entry %v", mv.Msg.Entry)
	}
	if _, err := e.fs.Move(ctx, connect.NewRequest(&fspb.MoveRequest{Source: file, Destination: dst})); connect.CodeOf(err) != connect.CodeNotFound {
		t.Fatalf("Move missing: %v", err)
	}

	// Remove is recursive and fine on a missing path.
	for _, p := range []string{filepath.Join(dir, "moved"), filepath.Join(dir, "moved")} {
		if _, err := e.fs.Remove(ctx, connect.NewRequest(&fspb.RemoveRequest{Path: p})); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := os.Stat(dst); !os.IsNotExist(err) {
		t.Fatalf("still there: %v", err)
	}
}

func TestPortTunnel(t *testing.T) {
	e := newEnv(t, Config{})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				io.Copy(c, c) // echo until the client half-closes
			}()
		}
	}()
	port := ln.Addr().(*net.TCPAddr).Port

	c, err := net.Dial("unix", e.sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	// The request and the first tunnel bytes in one write.
	fmt.Fprintf(c, "GET /_opendsec/port/%d HTTP/1.1\r\nHost: agent\r\nConnection: Upgrade\r\nUpgrade: tcp\r\n\r\nearly-", port)
	br := bufio.NewReader(c)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != 101 || resp.Header.Get("Upgrade") != "tcp" {
		t.Fatalf("tunnel: %s %v", resp.Status, resp.Header)
	}
	c.Write([]byte("ping"))
	c.(*net.UnixConn).CloseWrite()
	got, err := io.ReadAll(br)
	if err != nil || string(got) != "early-ping" {
		t.Fatalf("echo = %q, %v", got, err)
	}

	// Closed port → 502; bad port → 400.
	closed, _ := net.Listen("tcp", "127.0.0.1:0")
	cport := closed.Addr().(*net.TCPAddr).Port
	closed.Close()
	r, b := e.do(t, "GET", fmt.Sprintf("%s/_opendsec/port/%d", base, cport), nil, map[string]string{"Connection": "Upgrade", "Upgrade": "tcp"})
	if r.StatusCode != 502 || !strings.Contains(string(b), fmt.Sprintf("connection refused in sandbox: port %d is not open", cport)) {
		t.Fatalf("closed port: %s %s", r.Status, b)
	}
	for _, p := range []string{"0", "65536", "abc"} {
		r, b = e.do(t, "GET", base+"/_opendsec/port/"+p, nil, map[string]string{"Connection": "Upgrade", "Upgrade": "tcp"})
		if r.StatusCode != 400 || !strings.Contains(string(b), "port") {
			t.Fatalf("port %s: %s %s", p, r.Status, b)
		}
	}
}

func TestEnvs(t *testing.T) {
	e := newEnv(t, Config{Env: []string{"A=1", "B=two=2"}})
	resp, b := e.do(t, "GET", base+"/envs", nil, nil)
	var m map[string]string
	if err := json.Unmarshal(b, &m); err != nil || resp.StatusCode != 200 || m["A"] != "1" || m["B"] != "two=2" || len(m) != 2 {
		t.Fatalf("envs: %s %s %v", resp.Status, b, err)
	}
}
