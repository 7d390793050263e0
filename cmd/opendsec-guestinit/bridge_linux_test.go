package main

import (
	"bufio"
	"context"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestFindPortByName(t *testing.T) {
	sys, dev := t.TempDir(), t.TempDir()
	for port, name := range map[string]string{"vport0p1": "other", "vport1p1": "agent"} {
		if err := os.MkdirAll(filepath.Join(sys, port), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(sys, port, "name"), []byte(name+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dev, port), nil, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	got, err := findPort(ctx, sys, dev, "agent")
	if err != nil || got != filepath.Join(dev, "vport1p1") {
		t.Fatalf("findPort = %q, %v; want %s", got, err, filepath.Join(dev, "vport1p1"))
	}
	short, cancel2 := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel2()
	if _, err := findPort(short, sys, dev, "missing"); err == nil {
		t.Fatal("findPort of a missing port: no error")
	}
}

// TestProxyDispatchesIdentity: a stream whose first request is POST
// /opendsec/identity is answered by the init (a bad body: 400, and the
// agent never sees it); any other stream goes to the agent byte for byte.
func TestProxyDispatchesIdentity(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "agent.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = l.Close() }()
	seen := make(chan string, 4)
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer func() { _ = c.Close() }()
				req, err := http.ReadRequest(bufio.NewReader(c))
				if err != nil {
					return
				}
				seen <- req.Method + " " + req.URL.Path
				_, _ = io.WriteString(c, "HTTP/1.1 204 No Content\r\nConnection: close\r\n\r\n")
			}()
		}
	}()
	do := func(method, path, body string) int {
		t.Helper()
		host, guest := net.Pipe()
		go proxy(guest, sock)
		defer func() { _ = host.Close() }()
		req, _ := http.NewRequest(method, "http://agent"+path, strings.NewReader(body))
		if err := req.Write(host); err != nil {
			t.Fatal(err)
		}
		resp, err := http.ReadResponse(bufio.NewReader(host), req)
		if err != nil {
			t.Fatal(err)
		}
		_ = resp.Body.Close()
		return resp.StatusCode
	}
	if code := do(http.MethodPost, "/opendsec/identity", "{broken"); code != http.StatusBadRequest {
		t.Fatalf("identity with a broken body: %d, want 400", code)
	}
	if code := do(http.MethodGet, "/health", ""); code != http.StatusNoContent {
		t.Fatalf("GET /health through the proxy: %d, want the agent's 204", code)
	}
	if got := <-seen; got != "GET /health" {
		t.Fatalf("the agent saw %q first, want GET /health (the identity request is the init's)", got)
	}
}
