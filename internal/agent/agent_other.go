//go:build !linux

package agent

import (
	"context"
	"errors"
	"net/http"
	"time"
)

// Agent is only implemented on Linux.
type Agent struct{}

// New fails: the agent runs only inside Linux sandboxes.
func New(ctx context.Context, cfg Config) (*Agent, error) {
	return nil, errors.New("opendsec-agent runs only on linux")
}

// Handler is never reached on other systems.
func (a *Agent) Handler() http.Handler { return http.NotFoundHandler() }

// Close does nothing.
func (a *Agent) Close() error { return nil }

// Busy reports nothing on other systems.
func (a *Agent) Busy() string { return "" }

// WaitIdle fails: idle exit needs Linux.
func (a *Agent) WaitIdle(ctx context.Context, d time.Duration) error {
	return errors.New("idle exit needs linux")
}
