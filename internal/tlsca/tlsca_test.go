package tlsca

import (
	"crypto/tls"
	"crypto/x509"
	"os"
	"path/filepath"
	"testing"
	"time"
)

func load(t *testing.T, p Paths) (*x509.Certificate, *x509.CertPool) {
	t.Helper()
	kp, err := tls.LoadX509KeyPair(p.Cert, p.Key)
	if err != nil {
		t.Fatal(err)
	}
	leaf, err := x509.ParseCertificate(kp.Certificate[0])
	if err != nil {
		t.Fatal(err)
	}
	caPEM, err := os.ReadFile(p.CA)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(caPEM) {
		t.Fatal("no CA certificate in", p.CA)
	}
	return leaf, pool
}

func TestEnsureWildcardSANsAndVerify(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "tls")
	now := time.Now()
	p, made, err := Ensure(dir, Names("Example.test", []string{"gw.internal", "10.1.2.3"}), now)
	if err != nil || !made {
		t.Fatalf("Ensure: made=%v err=%v", made, err)
	}
	leaf, pool := load(t, p)
	for _, host := range []string{"example.test", "49983-i1234567890abcdef.example.test", "localhost", "gw.internal", "127.0.0.1", "::1", "10.1.2.3"} {
		if _, err := leaf.Verify(x509.VerifyOptions{DNSName: host, Roots: pool, CurrentTime: now}); err != nil {
			t.Errorf("verify %s: %v", host, err)
		}
	}
	for _, host := range []string{"other.test", "a.b.example.test", "10.1.2.4"} {
		if _, err := leaf.Verify(x509.VerifyOptions{DNSName: host, Roots: pool, CurrentTime: now}); err == nil {
			t.Errorf("verify %s: want an error", host)
		}
	}
	if leaf.IsCA || leaf.NotAfter.Sub(now) > 398*24*time.Hour {
		t.Errorf("leaf: IsCA=%v NotAfter=%v", leaf.IsCA, leaf.NotAfter)
	}
	for _, f := range []string{p.Key, filepath.Join(dir, caKey)} {
		st, err := os.Stat(f)
		if err != nil {
			t.Fatal(err)
		}
		if st.Mode().Perm() != 0o600 {
			t.Errorf("%s: mode %v, want 0600", f, st.Mode().Perm())
		}
	}
}

func TestEnsureReusesAndRenews(t *testing.T) {
	dir := t.TempDir()
	now := time.Now()
	names := Names("opendsec.local", nil)
	p, _, err := Ensure(dir, names, now)
	if err != nil {
		t.Fatal(err)
	}
	first, _ := load(t, p)
	caBefore, _ := os.ReadFile(p.CA)

	// Same names: the certificate on disk is kept.
	if _, made, err := Ensure(dir, names, now.Add(time.Hour)); err != nil || made {
		t.Fatalf("second Ensure: made=%v err=%v, want reuse", made, err)
	}
	again, _ := load(t, p)
	if !again.Equal(first) {
		t.Fatal("certificate changed although the names did not")
	}

	// Another domain: a new server certificate from the same CA.
	_, made, err := Ensure(dir, Names("sbx.example.com", nil), now)
	if err != nil || !made {
		t.Fatalf("Ensure for a new domain: made=%v err=%v", made, err)
	}
	renewed, pool := load(t, p)
	if _, err := renewed.Verify(x509.VerifyOptions{DNSName: "8080-abc.sbx.example.com", Roots: pool, CurrentTime: now}); err != nil {
		t.Fatalf("renewed certificate: %v", err)
	}
	if err := renewed.VerifyHostname("x.opendsec.local"); err == nil {
		t.Fatal("renewed certificate still covers the old domain")
	}
	caAfter, _ := os.ReadFile(p.CA)
	if string(caBefore) != string(caAfter) {
		t.Fatal("the CA changed: clients trusting it would break")
	}

	// Near expiry: made again.
	if _, made, err := Ensure(dir, Names("sbx.example.com", nil), renewed.NotAfter.Add(-24*time.Hour)); err != nil || !made {
		t.Fatalf("Ensure near expiry: made=%v err=%v", made, err)
	}
}

func TestEnsureServesTLS(t *testing.T) {
	p, _, err := Ensure(t.TempDir(), Names("opendsec.local", nil), time.Now())
	if err != nil {
		t.Fatal(err)
	}
	kp, err := tls.LoadX509KeyPair(p.Cert, p.Key)
	if err != nil {
		t.Fatal(err)
	}
	_, pool := load(t, p)
	ln, err := tls.Listen("tcp", "127.0.0.1:0", &tls.Config{Certificates: []tls.Certificate{kp}})
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		c, err := ln.Accept()
		if err == nil {
			_ = c.(*tls.Conn).Handshake()
			c.Close()
		}
	}()
	c, err := tls.Dial("tcp", ln.Addr().String(), &tls.Config{RootCAs: pool, ServerName: "3000-abc.opendsec.local"})
	if err != nil {
		t.Fatal(err)
	}
	c.Close()
}
