package e2b

import (
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"sync"
	"time"

	"github.com/kernflux/opendsec/internal/errdefs"
)

// KeyPrefix starts every E2B API key.
const KeyPrefix = "e2b_"

var (
	keyRe       = regexp.MustCompile(`^e2b_[0-9a-f]{40}$`)
	principalRe = regexp.MustCompile(`^[a-z0-9][a-z0-9._-]{0,62}$`)
)

// KeyStore keeps E2B API keys in a small JSON file (only SHA-256 hashes of
// the keys are stored). Each key maps to an OpenDsec principal; sandboxes a
// key creates belong to that principal and are visible only to its keys.
// The file is re-read when it changes, so keys made by `opendsec e2b key
// create` work without a restart.
type KeyStore struct {
	path string

	mu sync.Mutex
	// keys (hash → entry) and modTime mirror the file; guarded by mu.
	keys    map[string]keyEntry
	modTime time.Time
	size    int64
}

type keyEntry struct {
	Hash      string    `json:"sha256"`
	Principal string    `json:"principal"`
	Prefix    string    `json:"prefix"`
	CreatedAt time.Time `json:"created_at"`
}

type keyFile struct {
	Keys []keyEntry `json:"keys"`
}

// NewKeyStore returns the store kept in path (created on the first Create).
func NewKeyStore(path string) *KeyStore {
	return &KeyStore{path: path}
}

func hashKey(key string) string {
	h := sha256.Sum256([]byte(key))
	return hex.EncodeToString(h[:])
}

// reload re-reads the file when its size or mtime changed. Callers hold mu.
func (s *KeyStore) reload() error {
	st, err := os.Stat(s.path)
	if errors.Is(err, fs.ErrNotExist) {
		s.keys, s.modTime, s.size = nil, time.Time{}, 0
		return nil
	}
	if err != nil {
		return fmt.Errorf("stat key file: %w", err)
	}
	if s.keys != nil && st.ModTime().Equal(s.modTime) && st.Size() == s.size {
		return nil
	}
	b, err := os.ReadFile(s.path)
	if err != nil {
		return fmt.Errorf("read key file: %w", err)
	}
	var f keyFile
	if err := json.Unmarshal(b, &f); err != nil {
		return errdefs.New(errdefs.ErrInternal, "key file %s is not valid JSON: %w; fix or remove it", s.path, err)
	}
	keys := make(map[string]keyEntry, len(f.Keys))
	for _, k := range f.Keys {
		keys[k.Hash] = k
	}
	s.keys, s.modTime, s.size = keys, st.ModTime(), st.Size()
	return nil
}

// Lookup returns the principal of key, or an unauthenticated error.
func (s *KeyStore) Lookup(key string) (string, error) {
	if key == "" {
		return "", errdefs.New(errdefs.ErrUnauthenticated, "missing API key: set E2B_API_KEY (create one with `opendsec e2b key create`)")
	}
	if !keyRe.MatchString(key) {
		return "", errdefs.New(errdefs.ErrUnauthenticated, "invalid API key: keys look like e2b_ followed by 40 hex characters")
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.reload(); err != nil {
		return "", err
	}
	h := hashKey(key)
	for hk, e := range s.keys {
		if subtle.ConstantTimeCompare([]byte(hk), []byte(h)) == 1 {
			return e.Principal, nil
		}
	}
	return "", errdefs.New(errdefs.ErrUnauthenticated, "invalid API key: it is not known to this OpenDsec; create one with `opendsec e2b key create`")
}

// Create makes a new key for principal, records its hash and returns it.
// The key is shown only once.
func (s *KeyStore) Create(principal string) (string, error) {
	if !principalRe.MatchString(principal) {
		return "", errdefs.Invalid("principal", "%q must be 1-63 characters of [a-z0-9._-] starting with a letter or digit, e.g. \"default\"", principal)
	}
	b := make([]byte, 20)
	if _, err := rand.Read(b); err != nil {
		return "", fmt.Errorf("random key: %w", err)
	}
	key := KeyPrefix + hex.EncodeToString(b)
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.reload(); err != nil {
		return "", err
	}
	f := keyFile{}
	for _, e := range s.keys {
		f.Keys = append(f.Keys, e)
	}
	f.Keys = append(f.Keys, keyEntry{Hash: hashKey(key), Principal: principal, Prefix: key[:8], CreatedAt: time.Now().UTC()})
	out, err := json.MarshalIndent(f, "", "  ")
	if err != nil {
		return "", fmt.Errorf("encode key file: %w", err)
	}
	if err := os.MkdirAll(filepath.Dir(s.path), 0o700); err != nil {
		return "", fmt.Errorf("make key dir: %w", err)
	}
	tmp := s.path + ".tmp"
	if err := os.WriteFile(tmp, append(out, '\n'), 0o600); err != nil {
		return "", fmt.Errorf("write key file: %w", err)
	}
	if err := os.Rename(tmp, s.path); err != nil {
		return "", fmt.Errorf("write key file: %w", err)
	}
	s.keys = nil // force a re-read next time
	return key, nil
}
