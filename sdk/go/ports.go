package opendsec

import (
	"context"
	"net/http"
	"time"

	"connectrpc.com/connect"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
)

// HTTPRequest is one HTTP request to a TCP port inside a sandbox.
type HTTPRequest struct {
	Port uint32
	// Method defaults to GET.
	Method string
	// Path is the path and query, e.g. "/api?x=1"; empty means "/".
	Path   string
	Header http.Header
	Body   []byte
	// Timeout bounds the request inside the sandbox; 0 means the server's default.
	Timeout time.Duration
}

// HTTPResponse is the answer to an HTTPRequest.
type HTTPResponse struct {
	StatusCode int
	Header     http.Header
	Body       []byte
}

// HTTPRequest sends req to a port inside sandbox id and returns the response.
// A response with any status is not an error; an error means the request
// could not be delivered.
func (c *Client) HTTPRequest(ctx context.Context, id string, req HTTPRequest) (*HTTPResponse, error) {
	if req.Port == 0 || req.Port > 65535 {
		return nil, invalid("port", "must be between 1 and 65535, got %d", req.Port)
	}
	m := &opendsecv1.HTTPRequestRequest{
		SandboxId: id,
		Port:      req.Port,
		Method:    req.Method,
		Path:      req.Path,
		Body:      req.Body,
		TimeoutMs: req.Timeout.Milliseconds(),
	}
	if m.Method == "" {
		m.Method = http.MethodGet
	}
	if m.Path == "" {
		m.Path = "/"
	}
	for name, values := range req.Header {
		for _, v := range values {
			m.Headers = append(m.Headers, &opendsecv1.Header{Name: name, Value: v})
		}
	}
	resp, err := c.ports.HTTPRequest(ctx, connect.NewRequest(m))
	if err != nil {
		return nil, convertError(err)
	}
	out := &HTTPResponse{StatusCode: int(resp.Msg.GetStatus()), Header: http.Header{}, Body: resp.Msg.GetBody()}
	for _, h := range resp.Msg.GetHeaders() {
		out.Header.Add(h.GetName(), h.GetValue())
	}
	return out, nil
}
