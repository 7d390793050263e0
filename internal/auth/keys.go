package auth

import (
	"crypto/ed25519"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/kernflux/opendsec/internal/errdefs"
)

// Key files are PEM: the private key PKCS #8 ("PRIVATE KEY"), the public
// key PKIX ("PUBLIC KEY"), as `openssl genpkey -algorithm ed25519` writes
// them.

// LoadIssuer reads the ed25519 private key at path.
func LoadIssuer(path string) (*Issuer, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil, errdefs.New(errdefs.ErrFailedPrecondition,
				"no token-signing private key at %s: only the issuer (`opendsec up`, or wherever auth.private_key_file is) can mint tokens", path)
		}
		return nil, fmt.Errorf("read private key: %w", err)
	}
	blk, _ := pem.Decode(b)
	if blk == nil || blk.Type != "PRIVATE KEY" {
		return nil, errdefs.Invalid("auth.private_key_file", "%s is not a PEM \"PRIVATE KEY\" (PKCS #8 ed25519)", path)
	}
	k, err := x509.ParsePKCS8PrivateKey(blk.Bytes)
	if err != nil {
		return nil, errdefs.Invalid("auth.private_key_file", "%s: %v", path, err)
	}
	priv, ok := k.(ed25519.PrivateKey)
	if !ok {
		return nil, errdefs.Invalid("auth.private_key_file", "%s holds a %T; tokens are signed with ed25519", path, k)
	}
	return NewIssuer(priv)
}

// LoadPublicKey reads the ed25519 public key at path.
func LoadPublicKey(path string) (ed25519.PublicKey, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil, errdefs.New(errdefs.ErrFailedPrecondition,
				"no token-verifying public key at %s: copy the issuer's auth.ed25519.pub there (or set auth.public_key_file)", path)
		}
		return nil, fmt.Errorf("read public key: %w", err)
	}
	blk, _ := pem.Decode(b)
	if blk == nil || blk.Type != "PUBLIC KEY" {
		return nil, errdefs.Invalid("auth.public_key_file", "%s is not a PEM \"PUBLIC KEY\" (PKIX ed25519)", path)
	}
	k, err := x509.ParsePKIXPublicKey(blk.Bytes)
	if err != nil {
		return nil, errdefs.Invalid("auth.public_key_file", "%s: %v", path, err)
	}
	pub, ok := k.(ed25519.PublicKey)
	if !ok {
		return nil, errdefs.Invalid("auth.public_key_file", "%s holds a %T; tokens are signed with ed25519", path, k)
	}
	return pub, nil
}

// LoadOrCreateIssuer reads the private key at privPath, or when it is
// missing generates a key pair and writes it (private 0600, public 0644 at
// pubPath, directories 0700). created reports a new pair. An existing
// private key whose public file is missing gets it written again.
func LoadOrCreateIssuer(privPath, pubPath string) (iss *Issuer, created bool, err error) {
	iss, err = LoadIssuer(privPath)
	switch {
	case err == nil:
		if _, perr := os.Stat(pubPath); errors.Is(perr, fs.ErrNotExist) {
			if err := writePublic(pubPath, iss.PublicKey()); err != nil {
				return nil, false, err
			}
		}
		return iss, false, nil
	case !errors.Is(err, errdefs.ErrFailedPrecondition):
		return nil, false, err
	}
	if iss, err = GenerateIssuer(); err != nil {
		return nil, false, err
	}
	der, err := x509.MarshalPKCS8PrivateKey(iss.priv)
	if err != nil {
		return nil, false, fmt.Errorf("encode private key: %w", err)
	}
	if err := os.MkdirAll(filepath.Dir(privPath), 0o700); err != nil {
		return nil, false, fmt.Errorf("create key directory: %w", err)
	}
	f, err := os.OpenFile(privPath, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if errors.Is(err, fs.ErrExist) {
		// Another process created it first: use theirs.
		iss, _, err := LoadOrCreateIssuer(privPath, pubPath)
		return iss, false, err
	}
	if err != nil {
		return nil, false, fmt.Errorf("create private key: %w", err)
	}
	werr := pem.Encode(f, &pem.Block{Type: "PRIVATE KEY", Bytes: der})
	if werr == nil {
		werr = f.Sync()
	}
	if cerr := f.Close(); werr == nil {
		werr = cerr
	}
	if werr != nil {
		os.Remove(privPath)
		return nil, false, fmt.Errorf("write private key: %w", werr)
	}
	if err := writePublic(pubPath, iss.PublicKey()); err != nil {
		return nil, false, err
	}
	return iss, true, nil
}

func writePublic(path string, pub ed25519.PublicKey) error {
	der, err := x509.MarshalPKIXPublicKey(pub)
	if err != nil {
		return fmt.Errorf("encode public key: %w", err)
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return fmt.Errorf("create key directory: %w", err)
	}
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: der}), 0o644); err != nil {
		return fmt.Errorf("write public key: %w", err)
	}
	if err := os.Rename(tmp, path); err != nil {
		return fmt.Errorf("write public key: %w", err)
	}
	return nil
}
