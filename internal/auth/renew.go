package auth

import (
	"context"
	"fmt"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/log"
)

// ServiceTokenTTL is the lifetime of the tokens components mint for calls
// to each other. They are renewed at half their lifetime (ServiceToken.Run),
// so a leaked one is useless within the hour.
const ServiceTokenTTL = time.Hour

// TokenSource supplies the token for each outgoing call.
type TokenSource interface {
	Token() string
}

// StaticToken is a TokenSource that always returns the same token.
type StaticToken string

// Token returns s.
func (s StaticToken) Token() string { return string(s) }

// ServiceToken is a short-lived token that the component holding it renews
// before it expires: Run renews it in the background at half its lifetime,
// and Token renews it on the spot if that moment has passed anyway (Run not
// started yet, or the machine was suspended).
type ServiceToken struct {
	minter         Minter
	subject, scope string
	ttl            time.Duration

	mu      sync.Mutex
	tok     string    // guarded by mu
	renewAt time.Time // guarded by mu
	expires time.Time // guarded by mu
}

var _ TokenSource = (*ServiceToken)(nil)

// NewServiceToken issues with m the first token for subject with scope,
// each valid for ttl (ServiceTokenTTL if 0).
func NewServiceToken(m Minter, subject, scope string, ttl time.Duration) (*ServiceToken, error) {
	if ttl == 0 {
		ttl = ServiceTokenTTL
	}
	s := &ServiceToken{minter: m, subject: subject, scope: scope, ttl: ttl}
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.renewLocked(time.Now()); err != nil {
		return nil, err
	}
	return s, nil
}

// renewLocked issues a new token. The renewal point is half way to the
// token's real expiry (claims carry whole seconds, so that is up to a
// second before now+ttl).
func (s *ServiceToken) renewLocked(now time.Time) error {
	tok, err := s.minter.Issue(s.subject, s.scope, s.ttl)
	if err != nil {
		return err
	}
	c, err := peekClaims(tok)
	if err != nil {
		return err
	}
	s.tok, s.expires = tok, c.Expiry()
	s.renewAt = now.Add(s.expires.Sub(now) / 2)
	return nil
}

// Token returns the current token, renewing it first when its renewal
// point has passed.
func (s *ServiceToken) Token() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	if now := time.Now(); !now.Before(s.renewAt) {
		// Issue fails only on a bad key or no randomness: keep the old
		// token, which may still be valid; Run logs its own failures.
		_ = s.renewLocked(now)
	}
	return s.tok
}

// Expiry returns when the current token expires.
func (s *ServiceToken) Expiry() time.Time {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.expires
}

// Run renews the token at half its lifetime until ctx ends.
func (s *ServiceToken) Run(ctx context.Context) {
	for {
		s.mu.Lock()
		wait := time.Until(s.renewAt)
		s.mu.Unlock()
		t := time.NewTimer(max(wait, 0))
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		s.mu.Lock()
		now := time.Now()
		var err error
		if !now.Before(s.renewAt) {
			err = s.renewLocked(now)
			if err != nil {
				// Try again in a second rather than spin.
				s.renewAt = now.Add(time.Second)
			}
		}
		exp := s.expires
		s.mu.Unlock()
		if err != nil {
			log.G(ctx).Error("renew service token", "subject", s.subject, log.Err(err))
		} else {
			log.G(ctx).Debug("service token renewed", "subject", s.subject, "expires", exp)
		}
	}
}

// FileToken is a TokenSource reading a token an operator minted (`opendsec
// token create --scope node`) from a file: the separate opendsec-apiserver
// and opendsec-watcher, which hold only the public key, call other
// components with it. The file is read again when it changes (checked at
// most every FileTokenRecheck), so a token is rotated by rewriting the file.
type FileToken struct {
	path string

	mu      sync.Mutex
	tok     string    // guarded by mu
	modTime time.Time // guarded by mu
	checked time.Time // guarded by mu
}

// FileTokenRecheck is how often FileToken looks for a changed file.
const FileTokenRecheck = 10 * time.Second

var _ TokenSource = (*FileToken)(nil)

// NewFileToken reads the token in path; it fails when the file is missing
// or holds no token, so a misconfigured component fails at start.
func NewFileToken(path string) (*FileToken, error) {
	f := &FileToken{path: path}
	if err := f.load(time.Now()); err != nil {
		return nil, err
	}
	return f, nil
}

func (f *FileToken) load(now time.Time) error {
	st, err := os.Stat(f.path)
	if err != nil {
		return errdefs.New(errdefs.ErrFailedPrecondition,
			"service token file %s: %v; mint one on the issuer with `opendsec token create --scope node --subject <component> --ttl 720h > %s`", f.path, err, f.path)
	}
	f.checked = now
	if st.ModTime().Equal(f.modTime) && f.tok != "" {
		return nil
	}
	b, err := os.ReadFile(f.path)
	if err != nil {
		return fmt.Errorf("read service token: %w", err)
	}
	tok := strings.TrimSpace(string(b))
	if !strings.HasPrefix(tok, Prefix) {
		return errdefs.Invalid("auth.service_token_file", "%s holds no OpenDsec token (odt_...)", f.path)
	}
	f.tok, f.modTime = tok, st.ModTime()
	return nil
}

// Token returns the file's token, reading the file again when it changed.
func (f *FileToken) Token() string {
	f.mu.Lock()
	defer f.mu.Unlock()
	if now := time.Now(); now.Sub(f.checked) >= FileTokenRecheck {
		// On a failed read keep the token we have.
		_ = f.load(now)
	}
	return f.tok
}
