package apiserver_test

import (
	"bufio"
	"fmt"
	"net"
	"net/http"
	"strings"
	"testing"

	"connectrpc.com/connect"

	v1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/internal/apiserver"
)

// A server in the sandbox that sends endless headers gets a clear error
// once MaxHTTPHeaderBytes were read; headers under the cap still pass.
func TestHTTPRequestHeaderLimit(t *testing.T) {
	e := setup(t, nil, "n001")
	id := e.create(busybox()).GetId()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	sent := make(chan int64, 1)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				req, err := http.ReadRequest(bufio.NewReader(c))
				if err != nil {
					return
				}
				if req.URL.Path == "/ok" {
					// 512 KiB of headers: under the cap.
					fmt.Fprintf(c, "HTTP/1.1 200 OK\r\nX-Big: %s\r\nContent-Length: 2\r\n\r\nok", strings.Repeat("h", 512<<10))
					return
				}
				w := bufio.NewWriter(c)
				var n int64
				w.WriteString("HTTP/1.1 200 OK\r\n")
				for i := 0; ; i++ {
					k, err := fmt.Fprintf(w, "X-H%d: %s\r\n", i, strings.Repeat("v", 1000))
					n += int64(k)
					if err != nil || n > 64*apiserver.MaxHTTPHeaderBytes {
						break
					}
				}
				sent <- n
			}()
		}
	}()
	agent := e.nodes[0].agent
	agent.mu.Lock()
	agent.ports[8000] = ln.Addr().String()
	agent.mu.Unlock()

	resp, err := e.port.HTTPRequest(t.Context(), connect.NewRequest(&v1.HTTPRequestRequest{SandboxId: id, Port: 8000, Path: "/ok"}))
	if err != nil {
		t.Fatal(err)
	}
	if string(resp.Msg.GetBody()) != "ok" {
		t.Fatalf("body = %q, want ok", resp.Msg.GetBody())
	}

	_, err = e.port.HTTPRequest(t.Context(), connect.NewRequest(&v1.HTTPRequestRequest{SandboxId: id, Port: 8000, Path: "/endless"}))
	wantCode(t, err, connect.CodeResourceExhausted, fmt.Sprintf("headers from port 8000 exceed %d bytes", apiserver.MaxHTTPHeaderBytes))
	// The apiserver stopped reading: the server's writes failed long
	// before it sent 64 times the cap.
	if n := <-sent; n > 64*apiserver.MaxHTTPHeaderBytes {
		t.Fatalf("the server wrote %d bytes of headers unhindered", n)
	}
}
