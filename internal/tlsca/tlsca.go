// Package tlsca is OpenDsec's own certificate authority for serving TLS
// where no operator certificate is configured (the E2B gateway's
// `*.<domain>` sandbox hosts). The CA and a server certificate signed by it
// are made once and kept in a directory (keys 0600); the server certificate
// is made again when the names it must cover change or it nears expiry,
// and the CA is kept, so clients that trust it once keep trusting.
package tlsca

import (
	"bytes"
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"
)

// File names inside the directory.
const (
	CAFile   = "ca.pem"
	caKey    = "ca.key"
	CertFile = "server.pem"
	KeyFile  = "server.key"
)

const (
	caLifetime   = 10 * 365 * 24 * time.Hour
	leafLifetime = 397 * 24 * time.Hour
	// renewBefore: a server certificate this close to expiry is made again.
	renewBefore = 30 * 24 * time.Hour
)

// Paths are the files of a CA directory.
type Paths struct {
	CA, Cert, Key string
}

// PathsIn returns the file paths in dir.
func PathsIn(dir string) Paths {
	return Paths{CA: filepath.Join(dir, CAFile), Cert: filepath.Join(dir, CertFile), Key: filepath.Join(dir, KeyFile)}
}

// Names is what the server certificate of the E2B gateway covers: the
// domain and its wildcard (the sandbox hosts <port>-<id>.<domain>),
// localhost, 127.0.0.1, ::1, and extra (DNS names or IP addresses).
func Names(domain string, extra []string) []string {
	var n []string
	if domain = strings.Trim(strings.ToLower(domain), "."); domain != "" {
		n = append(n, domain, "*."+domain)
	}
	n = append(n, "localhost", "127.0.0.1", "::1")
	for _, e := range extra {
		if e = strings.TrimSpace(e); e != "" {
			n = append(n, strings.ToLower(e))
		}
	}
	slices.Sort(n)
	return slices.Compact(n)
}

// Ensure makes dir's CA (if it has none) and a server certificate for names
// (DNS names, wildcards or IP addresses), unless the one there already
// covers exactly these names, is signed by the CA and is not near expiry.
// It returns the paths and whether the server certificate was (re)made.
func Ensure(dir string, names []string, now time.Time) (Paths, bool, error) {
	p := PathsIn(dir)
	if len(names) == 0 {
		return p, false, errors.New("tlsca: no names for the server certificate")
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return p, false, fmt.Errorf("tlsca: %w", err)
	}
	ca, caPriv, err := loadOrMakeCA(dir, now)
	if err != nil {
		return p, false, err
	}
	if leafOK(p, ca, names, now) {
		return p, false, nil
	}
	if err := makeLeaf(p, ca, caPriv, names, now); err != nil {
		return p, false, err
	}
	return p, true, nil
}

func loadOrMakeCA(dir string, now time.Time) (*x509.Certificate, crypto.Signer, error) {
	certPath, keyPath := filepath.Join(dir, CAFile), filepath.Join(dir, caKey)
	if certPEM, err := os.ReadFile(certPath); err == nil {
		keyPEM, err := os.ReadFile(keyPath)
		if err != nil {
			return nil, nil, fmt.Errorf("tlsca: CA certificate %s without its key: %w", certPath, err)
		}
		kp, err := tls.X509KeyPair(certPEM, keyPEM)
		if err != nil {
			return nil, nil, fmt.Errorf("tlsca: CA in %s: %w", dir, err)
		}
		signer, ok := kp.PrivateKey.(crypto.Signer)
		if !ok {
			return nil, nil, fmt.Errorf("tlsca: CA key %s cannot sign", keyPath)
		}
		ca, err := x509.ParseCertificate(kp.Certificate[0])
		if err != nil {
			return nil, nil, fmt.Errorf("tlsca: %s: %w", certPath, err)
		}
		if now.After(ca.NotAfter) {
			return nil, nil, fmt.Errorf("tlsca: CA %s expired on %s; move it away to make a new one (clients must trust the new one)", certPath, ca.NotAfter.Format(time.DateOnly))
		}
		return ca, signer, nil
	} else if !errors.Is(err, os.ErrNotExist) {
		return nil, nil, fmt.Errorf("tlsca: %w", err)
	}
	priv, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, fmt.Errorf("tlsca: %w", err)
	}
	host, _ := os.Hostname()
	tmpl := &x509.Certificate{
		SerialNumber:          serial(),
		Subject:               pkix.Name{Organization: []string{"OpenDsec"}, CommonName: "OpenDsec CA " + host},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.Add(caLifetime),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
		MaxPathLenZero:        true,
		SubjectKeyId:          keyID(&priv.PublicKey),
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &priv.PublicKey, priv)
	if err != nil {
		return nil, nil, fmt.Errorf("tlsca: %w", err)
	}
	// Key first: a CA certificate without its key is an error above.
	if err := writeKey(keyPath, priv); err != nil {
		return nil, nil, err
	}
	if err := writeAtomic(certPath, pemBytes("CERTIFICATE", der), 0o644); err != nil {
		return nil, nil, err
	}
	ca, err := x509.ParseCertificate(der)
	return ca, priv, err
}

// leafOK reports whether the server certificate at p is for exactly names,
// verifies with ca and is not near expiry; a key that does not match it is
// not OK either.
func leafOK(p Paths, ca *x509.Certificate, names []string, now time.Time) bool {
	kp, err := tls.LoadX509KeyPair(p.Cert, p.Key)
	if err != nil {
		return false
	}
	leaf, err := x509.ParseCertificate(kp.Certificate[0])
	if err != nil || now.Add(renewBefore).After(leaf.NotAfter) {
		return false
	}
	var have []string
	have = append(have, leaf.DNSNames...)
	for _, ip := range leaf.IPAddresses {
		have = append(have, ip.String())
	}
	want := slices.Clone(names)
	for i, n := range want {
		if ip := net.ParseIP(n); ip != nil {
			want[i] = ip.String()
		}
	}
	slices.Sort(have)
	slices.Sort(want)
	if !slices.Equal(slices.Compact(have), slices.Compact(want)) {
		return false
	}
	return leaf.CheckSignatureFrom(ca) == nil
}

func makeLeaf(p Paths, ca *x509.Certificate, caPriv crypto.Signer, names []string, now time.Time) error {
	priv, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return fmt.Errorf("tlsca: %w", err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:   serial(),
		Subject:        pkix.Name{Organization: []string{"OpenDsec"}, CommonName: names[0]},
		NotBefore:      now.Add(-time.Hour),
		NotAfter:       now.Add(leafLifetime),
		KeyUsage:       x509.KeyUsageDigitalSignature,
		ExtKeyUsage:    []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		AuthorityKeyId: ca.SubjectKeyId,
	}
	for _, n := range names {
		if ip := net.ParseIP(n); ip != nil {
			tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
		} else {
			tmpl.DNSNames = append(tmpl.DNSNames, n)
		}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &priv.PublicKey, caPriv)
	if err != nil {
		return fmt.Errorf("tlsca: server certificate for %s: %w", strings.Join(names, ", "), err)
	}
	if err := writeKey(p.Key, priv); err != nil {
		return err
	}
	// The chain: the server certificate, then the CA's.
	chain := append(pemBytes("CERTIFICATE", der), pemBytes("CERTIFICATE", ca.Raw)...)
	return writeAtomic(p.Cert, chain, 0o644)
}

func writeKey(path string, priv *ecdsa.PrivateKey) error {
	der, err := x509.MarshalPKCS8PrivateKey(priv)
	if err != nil {
		return fmt.Errorf("tlsca: %w", err)
	}
	return writeAtomic(path, pemBytes("PRIVATE KEY", der), 0o600)
}

func writeAtomic(path string, data []byte, mode os.FileMode) error {
	f, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".*")
	if err != nil {
		return fmt.Errorf("tlsca: %w", err)
	}
	defer os.Remove(f.Name())
	err = f.Chmod(mode)
	if err == nil {
		_, err = f.Write(data)
	}
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(f.Name(), path)
	}
	if err != nil {
		return fmt.Errorf("tlsca: write %s: %w", path, err)
	}
	return nil
}

func pemBytes(typ string, der []byte) []byte {
	var b bytes.Buffer
	_ = pem.Encode(&b, &pem.Block{Type: typ, Bytes: der})
	return b.Bytes()
}

func serial() *big.Int {
	n, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		panic(err)
	}
	return n
}

func keyID(pub *ecdsa.PublicKey) []byte {
	der, _ := x509.MarshalPKIXPublicKey(pub)
	sum := sha256.Sum256(der)
	return sum[:20]
}
