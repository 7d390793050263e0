package auth

import (
	"context"
	"sync"
	"time"

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
	key            []byte
	subject, scope string
	ttl            time.Duration

	mu      sync.Mutex
	tok     string    // guarded by mu
	renewAt time.Time // guarded by mu
	expires time.Time // guarded by mu
}

var _ TokenSource = (*ServiceToken)(nil)

// NewServiceToken issues the first token for subject with scope, each
// valid for ttl (ServiceTokenTTL if 0).
func NewServiceToken(key []byte, subject, scope string, ttl time.Duration) (*ServiceToken, error) {
	if ttl == 0 {
		ttl = ServiceTokenTTL
	}
	s := &ServiceToken{key: key, subject: subject, scope: scope, ttl: ttl}
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
	tok, err := Issue(s.key, s.subject, s.scope, s.ttl)
	if err != nil {
		return err
	}
	c, err := Verify(s.key, tok, now)
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
