package nodeclient_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"connectrpc.com/connect"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/nodeclient"
)

func answer(status int, body string) *http.Response {
	rec := httptest.NewRecorder()
	rec.WriteHeader(status)
	rec.WriteString(body)
	return rec.Result()
}

func TestMapResponse(t *testing.T) {
	for _, tc := range []struct {
		status int
		body   string
		cat    error
		msg    string
	}{
		// The node's JSON names the connect code: categories sharing a
		// status stay apart.
		{400, `{"code":400,"message":"sandbox x is paused; resume it first","status":"failed_precondition"}`, errdefs.ErrFailedPrecondition, "sandbox x is paused; resume it first"},
		{400, `{"code":400,"message":"path: bad","status":"invalid_argument"}`, errdefs.ErrInvalidArgument, "path: bad"},
		{404, `{"code":404,"message":"sandbox x is stopped","status":"not_found"}`, errdefs.ErrNotFound, "sandbox x is stopped"},
		{503, `{"code":503,"message":"agent of sandbox x unreachable","status":"unavailable"}`, errdefs.ErrUnavailable, "agent of sandbox x unreachable"},
		// An unknown status name falls back to the HTTP status.
		{409, `{"code":409,"message":"exists","status":"no_such_code"}`, errdefs.ErrAlreadyExists, "exists"},
		// envd's JSON has no status: the HTTP status decides.
		{400, `{"code":400,"message":"want application/octet-stream"}`, errdefs.ErrInvalidArgument, "want application/octet-stream"},
		{401, `{"code":401,"message":"no token"}`, errdefs.ErrUnauthenticated, "no token"},
		{403, `{"code":403,"message":"user x may not"}`, errdefs.ErrPermissionDenied, "user x may not"},
		{404, `{"code":404,"message":"path '/x' does not exist"}`, errdefs.ErrNotFound, "path '/x' does not exist"},
		{413, `{"code":413,"message":"too big"}`, errdefs.ErrResourceExhausted, "too big"},
		{429, `{"code":429,"message":"slow down"}`, errdefs.ErrResourceExhausted, "slow down"},
		{507, `{"code":507,"message":"disk full"}`, errdefs.ErrResourceExhausted, "disk full"},
		{502, `{"code":502,"message":"port 9 is not open"}`, errdefs.ErrUnavailable, "port 9 is not open"},
		{504, `{"code":504,"message":"slow"}`, errdefs.ErrDeadlineExceeded, "slow"},
		{501, `{"code":501,"message":"no"}`, errdefs.ErrUnimplemented, "no"},
		{500, `{"code":500,"message":"boom"}`, errdefs.ErrInternal, "boom"},
		{418, `{"code":418,"message":"teapot"}`, errdefs.ErrInternal, "teapot"},
		// Text and empty bodies.
		{502, "bad gateway\n", errdefs.ErrUnavailable, "bad gateway"},
		{503, "", errdefs.ErrUnavailable, "read file: 503 Service Unavailable"},
		{404, `{"code":404}`, errdefs.ErrNotFound, `{"code":404}`},
		// A sandbox that died: the reason rides along (see below).
		{400, `{"code":400,"died":"killed by signal 9","message":"sandbox x died: killed by signal 9; create a new one","status":"failed_precondition"}`, errdefs.ErrFailedPrecondition, "sandbox x died: killed by signal 9; create a new one"},
	} {
		t.Run(fmt.Sprintf("%d %s", tc.status, tc.body), func(t *testing.T) {
			err := nodeclient.MapResponse(answer(tc.status, tc.body), "read file")
			var re *nodeclient.ResponseError
			if !errors.As(err, &re) || re.StatusCode != tc.status {
				t.Fatalf("err = %#v, want a ResponseError with status %d", err, tc.status)
			}
			if !errors.Is(err, tc.cat) || err.Error() != tc.msg {
				t.Fatalf("err = %q (code %v), want %q of category %v", err, errdefs.Code(err), tc.msg, tc.cat)
			}
			var de *errdefs.DiedError
			if died := strings.Contains(tc.body, `"died"`); errors.As(err, &de) != died || (died && de.Reason != "killed by signal 9") {
				t.Fatalf("err = %q: DiedError %v, want one only for a died answer", err, de)
			}
		})
	}
}

func TestMapError(t *testing.T) {
	transport := errors.New("dial tcp 10.0.0.1:7071: connect: connection refused")
	for _, tc := range []struct {
		name string
		err  error
		cat  error
		msg  string
	}{
		{"connect not_found", connect.NewError(connect.CodeNotFound, errors.New("sandbox x not found")), errdefs.ErrNotFound, "sandbox x not found"},
		{"connect resource_exhausted", connect.NewError(connect.CodeResourceExhausted, errors.New("node full")), errdefs.ErrResourceExhausted, "node full"},
		{"connect unavailable", connect.NewError(connect.CodeUnavailable, errors.New("down")), errdefs.ErrUnavailable, "down"},
		{"connect unknown", connect.NewError(connect.CodeUnknown, errors.New("odd")), errdefs.ErrInternal, "odd"},
		{"wrapped connect", fmt.Errorf("call: %w", connect.NewError(connect.CodePermissionDenied, errors.New("no"))), errdefs.ErrPermissionDenied, "no"},
		{"categorized", errdefs.New(errdefs.ErrFailedPrecondition, "paused"), errdefs.ErrFailedPrecondition, "paused"},
		{"response", nodeclient.MapResponse(answer(502, `{"message":"port 9 is not open"}`), "tunnel"), errdefs.ErrUnavailable, "port 9 is not open"},
		{"transport", transport, errdefs.ErrUnavailable, "stop sandbox: " + transport.Error()},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := nodeclient.MapError(t.Context(), "stop sandbox", tc.err)
			if !errors.Is(err, tc.cat) || err.Error() != tc.msg {
				t.Fatalf("err = %q (code %v), want %q of category %v", err, errdefs.Code(err), tc.msg, tc.cat)
			}
		})
	}
	if err := nodeclient.MapError(t.Context(), "x", nil); err != nil {
		t.Fatalf("nil: %v", err)
	}
	ctx, cancel := context.WithCancelCause(t.Context())
	cause := errdefs.New(errdefs.ErrDeadlineExceeded, "no answer within 1s")
	cancel(cause)
	if err := nodeclient.MapError(ctx, "x", connect.NewError(connect.CodeCanceled, context.Canceled)); err != cause {
		t.Fatalf("after the context ended: %v, want its cause", err)
	}
	if err := nodeclient.MapError(t.Context(), "x", transport); !strings.Contains(err.Error(), "connection refused") {
		t.Fatalf("transport error lost its text: %v", err)
	}
}
