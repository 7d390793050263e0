package httpserver

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/kernflux/opendsec/internal/tlsca"
)

// TestServeTLSNegotiatesH2 serves over TLS with a certificate from
// OpenDsec's CA: a client trusting the CA speaks HTTP/2 to a wildcard host,
// a streamed response arrives before the handler ends, and an aborted
// response is a stream reset, not a clean end of the body.
func TestServeTLSNegotiatesH2(t *testing.T) {
	p, _, err := tlsca.Ensure(t.TempDir(), tlsca.Names("opendsec.local", nil), time.Now())
	if err != nil {
		t.Fatal(err)
	}
	kp, err := tls.LoadX509KeyPair(p.Cert, p.Key)
	if err != nil {
		t.Fatal(err)
	}
	release := make(chan struct{})
	mux := http.NewServeMux()
	mux.HandleFunc("/proto", func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, r.Proto+" "+r.Host)
	})
	mux.HandleFunc("/abort", func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, "first ")
		w.(http.Flusher).Flush()
		<-release
		panic(http.ErrAbortHandler)
	})
	ln, err := Listen("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- ServeTLS(ctx, "test", ln, mux, &tls.Config{Certificates: []tls.Certificate{kp}}) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	}()

	caPEM, err := os.ReadFile(p.CA)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(caPEM)
	addr := ln.Addr().String()
	tr := &http.Transport{
		TLSClientConfig:   &tls.Config{RootCAs: pool},
		ForceAttemptHTTP2: true,
		// The test's resolver: every name is the server.
		DialContext: func(ctx context.Context, network, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, network, addr)
		},
	}
	defer tr.CloseIdleConnections()
	c := &http.Client{Transport: tr, Timeout: 10 * time.Second}

	resp, err := c.Get("https://49983-i0123456789abcdef.opendsec.local/proto")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.ProtoMajor != 2 || string(body) != "HTTP/2.0 49983-i0123456789abcdef.opendsec.local" {
		t.Fatalf("proto %s, body %q; want HTTP/2 to the sandbox host", resp.Proto, body)
	}

	resp, err = c.Get("https://49983-i0123456789abcdef.opendsec.local/abort")
	if err != nil {
		t.Fatal(err)
	}
	first := make([]byte, len("first "))
	if _, err := io.ReadFull(resp.Body, first); err != nil || string(first) != "first " {
		t.Fatalf("streamed part: %q, %v (not flushed before the handler ended?)", first, err)
	}
	close(release)
	_, err = io.ReadAll(resp.Body)
	resp.Body.Close()
	if err == nil || !strings.Contains(err.Error(), "stream error") {
		t.Fatalf("aborted response read: %v; want an HTTP/2 stream error (RST_STREAM)", err)
	}
}
