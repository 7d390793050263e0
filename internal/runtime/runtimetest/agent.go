// Package runtimetest is the backend conformance suite: every runtime.Runtime
// implementation runs Suite against real sandboxes with the real
// opendsec-agent inside, plus helpers to reach that agent in other tests.
package runtimetest

import (
	"bytes"
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"time"

	"connectrpc.com/connect"

	"github.com/kernflux/opendsec/api/gen/process"
	"github.com/kernflux/opendsec/api/gen/process/processconnect"
	"github.com/kernflux/opendsec/internal/runtime"
)

// agentBaseURL is a placeholder host: every connection goes to AgentConn.
const agentBaseURL = "http://agent"

// AgentHTTPClient returns an HTTP client whose every connection is
// rt.AgentConn(id).
func AgentHTTPClient(rt runtime.Runtime, id string) *http.Client {
	return &http.Client{Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return rt.AgentConn(ctx, id)
		},
		DisableKeepAlives: true,
	}}
}

// Health does GET /health on the agent and returns the status code.
func Health(ctx context.Context, rt runtime.Runtime, id string) (int, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, agentBaseURL+"/health", nil)
	if err != nil {
		return 0, err
	}
	resp, err := AgentHTTPClient(rt, id).Do(req)
	if err != nil {
		return 0, err
	}
	resp.Body.Close()
	return resp.StatusCode, nil
}

// WaitAgent polls /health until it answers 204 or timeout passes.
func WaitAgent(ctx context.Context, rt runtime.Runtime, id string, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	var last error
	for {
		code, err := Health(ctx, rt, id)
		if err == nil && code == http.StatusNoContent {
			return nil
		}
		if err == nil {
			err = fmt.Errorf("GET /health: status %d", code)
		}
		last = err
		select {
		case <-ctx.Done():
			return fmt.Errorf("agent of %s not healthy after %s: %w", id, timeout, last)
		case <-time.After(5 * time.Millisecond):
		}
	}
}

// Result is what Run returns.
type Result struct {
	Stdout, Stderr string
	ExitCode       int
	// Status is the agent's end status (e.g. "exit status 1", "signal: killed").
	Status string
}

// Run starts cmd args... through the agent's process.Process/Start as user
// (empty means the agent's default) and collects its output until it ends.
func Run(ctx context.Context, rt runtime.Runtime, id, user, cmd string, args ...string) (Result, error) {
	var res Result
	c := processconnect.NewProcessClient(AgentHTTPClient(rt, id), agentBaseURL)
	noStdin := false
	req := connect.NewRequest(&process.StartRequest{
		Process: &process.ProcessConfig{Cmd: cmd, Args: args},
		Stdin:   &noStdin,
	})
	if user != "" {
		req.Header().Set("Authorization", "Basic "+base64.StdEncoding.EncodeToString([]byte(user+":")))
	}
	stream, err := c.Start(ctx, req)
	if err != nil {
		return res, fmt.Errorf("start process: %w", err)
	}
	defer stream.Close()
	var stdout, stderr bytes.Buffer
	ended := false
	for stream.Receive() {
		ev := stream.Msg().GetEvent()
		if d := ev.GetData(); d != nil {
			stdout.Write(d.GetStdout())
			stderr.Write(d.GetStderr())
		}
		if e := ev.GetEnd(); e != nil {
			res.ExitCode = int(e.GetExitCode())
			res.Status = e.GetStatus()
			ended = true
		}
	}
	res.Stdout, res.Stderr = stdout.String(), stderr.String()
	if err := stream.Err(); err != nil {
		return res, fmt.Errorf("process stream: %w", err)
	}
	if !ended {
		return res, fmt.Errorf("process stream ended without an end event")
	}
	return res, nil
}

// WriteFile writes data to path in the sandbox through the agent's
// POST /files (as the agent's default user).
func WriteFile(ctx context.Context, rt runtime.Runtime, id, path string, data []byte) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, agentBaseURL+"/files?path="+url.QueryEscape(path), bytes.NewReader(data))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/octet-stream")
	resp, err := AgentHTTPClient(rt, id).Do(req)
	if err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(resp.Body)
		return fmt.Errorf("write %s: status %d: %s", path, resp.StatusCode, b)
	}
	return nil
}

// ReadFile reads path in the sandbox through the agent's GET /files; a
// missing file is an error wrapping ErrNoFile.
func ReadFile(ctx context.Context, rt runtime.Runtime, id, path string) ([]byte, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, agentBaseURL+"/files?path="+url.QueryEscape(path), nil)
	if err != nil {
		return nil, err
	}
	resp, err := AgentHTTPClient(rt, id).Do(req)
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", path, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", path, err)
	}
	switch resp.StatusCode {
	case http.StatusOK:
		return b, nil
	case http.StatusNotFound:
		return nil, fmt.Errorf("read %s: %w", path, ErrNoFile)
	}
	return nil, fmt.Errorf("read %s: status %d: %s", path, resp.StatusCode, b)
}

// ErrNoFile is ReadFile's error for a missing file.
var ErrNoFile = errors.New("no such file")
