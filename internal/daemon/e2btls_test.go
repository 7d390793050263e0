package daemon

import (
	"crypto/x509"
	"path/filepath"
	"testing"
	"time"

	"github.com/kernflux/opendsec/internal/config"
	"github.com/kernflux/opendsec/internal/tlsca"
)

func TestE2BTLSConfig(t *testing.T) {
	dd := t.TempDir()
	cfg := config.Default(dd)
	cfg.E2B.Domain = "sbx.example.test"
	cfg.E2B.TLS = config.E2BTLS{Enabled: true, Names: []string{"gw.example.test"}}
	tc, ca, err := e2bTLSConfig(cfg, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	if ca != filepath.Join(dd, "e2b", "tls", tlsca.CAFile) {
		t.Fatalf("CA file %q", ca)
	}
	leaf, err := x509.ParseCertificate(tc.Certificates[0].Certificate[0])
	if err != nil {
		t.Fatal(err)
	}
	for _, h := range []string{"49983-abc.sbx.example.test", "api.sbx.example.test", "sbx.example.test", "gw.example.test", "127.0.0.1"} {
		if err := leaf.VerifyHostname(h); err != nil {
			t.Errorf("%s: %v", h, err)
		}
	}

	// The operator's files instead: no CA of OpenDsec's.
	cfg.E2B.TLS = config.E2BTLS{Enabled: true, CertFile: filepath.Join(dd, "e2b", "tls", tlsca.CertFile), KeyFile: filepath.Join(dd, "e2b", "tls", tlsca.KeyFile)}
	if _, ca, err := e2bTLSConfig(cfg, time.Now()); err != nil || ca != "" {
		t.Fatalf("operator's certificate: ca %q, %v", ca, err)
	}
	cfg.E2B.TLS.KeyFile = filepath.Join(dd, "missing.key")
	if _, _, err := e2bTLSConfig(cfg, time.Now()); err == nil {
		t.Fatal("a missing key file: want an error")
	}
}
