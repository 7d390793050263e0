package errdefs

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net/http"
	"strings"
	"testing"

	"connectrpc.com/connect"
)

func TestCategoriesCodesAndStatuses(t *testing.T) {
	for _, tc := range []struct {
		cat    error
		code   connect.Code
		status int
	}{
		{ErrInvalidArgument, connect.CodeInvalidArgument, http.StatusBadRequest},
		{ErrNotFound, connect.CodeNotFound, http.StatusNotFound},
		{ErrAlreadyExists, connect.CodeAlreadyExists, http.StatusConflict},
		{ErrFailedPrecondition, connect.CodeFailedPrecondition, http.StatusBadRequest},
		{ErrResourceExhausted, connect.CodeResourceExhausted, http.StatusTooManyRequests},
		{ErrUnavailable, connect.CodeUnavailable, http.StatusServiceUnavailable},
		{ErrDeadlineExceeded, connect.CodeDeadlineExceeded, http.StatusGatewayTimeout},
		{ErrUnauthenticated, connect.CodeUnauthenticated, http.StatusUnauthorized},
		{ErrPermissionDenied, connect.CodePermissionDenied, http.StatusForbidden},
		{ErrUnimplemented, connect.CodeUnimplemented, http.StatusNotImplemented},
		{ErrCanceled, connect.CodeCanceled, 499},
		{ErrInternal, connect.CodeInternal, http.StatusInternalServerError},
		{context.DeadlineExceeded, connect.CodeDeadlineExceeded, http.StatusGatewayTimeout},
		{context.Canceled, connect.CodeCanceled, 499},
	} {
		t.Run(tc.cat.Error(), func(t *testing.T) {
			err := fmt.Errorf("outer: %w", New(tc.cat, "thing %q", "x"))
			if !errors.Is(err, tc.cat) {
				t.Fatalf("errors.Is(%v, %v) = false", err, tc.cat)
			}
			if got := Code(err); got != tc.code {
				t.Fatalf("Code = %v, want %v", got, tc.code)
			}
			if got := HTTPStatus(err); got != tc.status {
				t.Fatalf("HTTPStatus = %d, want %d", got, tc.status)
			}
			// Connect and back keeps the category and the message.
			back := FromConnect(ToConnect(err))
			if !errors.Is(back, tc.cat) && tc.cat != context.DeadlineExceeded && tc.cat != context.Canceled {
				t.Fatalf("FromConnect(ToConnect(err)) = %v, not %v", back, tc.cat)
			}
			if Code(back) != tc.code {
				t.Fatalf("code after a round trip = %v, want %v", Code(back), tc.code)
			}
			if tc.code != connect.CodeInternal && back.Error() != err.Error() {
				t.Fatalf("message after a round trip = %q, want %q", back.Error(), err.Error())
			}
		})
	}
	if Code(errors.New("plain")) != connect.CodeUnknown || HTTPStatus(errors.New("plain")) != http.StatusInternalServerError {
		t.Fatal("an uncategorized error must be unknown / 500")
	}
	if Code(nil) != connect.CodeUnknown || ToConnect(nil) != nil || FromConnect(nil) != nil {
		t.Fatal("nil must stay nil")
	}
}

func TestNewMessageHasNoCategoryPrefix(t *testing.T) {
	err := New(ErrNotFound, "sandbox %q not found", "abc")
	if err.Error() != `sandbox "abc" not found` {
		t.Fatalf("Error() = %q", err.Error())
	}
	if !IsNotFound(err) || IsInvalidArgument(err) {
		t.Fatal("IsNotFound/IsInvalidArgument wrong")
	}
}

type pathErr struct{ path string }

func (e *pathErr) Error() string { return "bad path " + e.path }

func TestNewKeepsTheCause(t *testing.T) {
	cause := &pathErr{path: "/var/lib/opendsec/x"}
	err := New(ErrUnavailable, "open table: %w; retry", cause)
	var pe *pathErr
	if !errors.As(err, &pe) || pe != cause {
		t.Fatalf("errors.As does not find the %%w cause")
	}
	if !errors.Is(err, ErrUnavailable) {
		t.Fatal("lost its own category")
	}
	if err.Error() != "open table: bad path /var/lib/opendsec/x; retry" {
		t.Fatalf("Error() = %q", err.Error())
	}
	// Two causes, as fmt.Errorf allows.
	err = New(ErrInternal, "%w and %w", fs.ErrNotExist, cause)
	if !errors.Is(err, fs.ErrNotExist) || !errors.As(err, &pe) {
		t.Fatal("a cause of two is lost")
	}
	// %v copies only the text.
	if err := New(ErrInternal, "%v", cause); errors.As(err, &pe) {
		t.Fatalf("a %%v argument must not be wrapped")
	}
}

func TestOutermostCategoryWins(t *testing.T) {
	inner := New(ErrNotFound, "layer gone")
	err := fmt.Errorf("create: %w", New(ErrUnavailable, "retry the create: %w", inner))
	if Code(err) != connect.CodeUnavailable || HTTPStatus(err) != http.StatusServiceUnavailable {
		t.Fatalf("Code = %v, want unavailable (the outer category)", Code(err))
	}
	if !errors.Is(err, ErrNotFound) {
		t.Fatal("the inner category must stay visible to errors.Is")
	}
}

func TestFieldError(t *testing.T) {
	err := fmt.Errorf("create sandbox: %w", Invalid("memory_mb", "must be between 1 and %d; ask for less", 4096))
	if !errors.Is(err, ErrInvalidArgument) || !IsInvalidArgument(err) {
		t.Fatal("a FieldError is an invalid argument")
	}
	var fe *FieldError
	if !errors.As(err, &fe) || fe.Field != "memory_mb" || fe.Msg != "must be between 1 and 4096; ask for less" {
		t.Fatalf("FieldError = %+v", fe)
	}
	if Code(err) != connect.CodeInvalidArgument || HTTPStatus(err) != http.StatusBadRequest {
		t.Fatal("wrong code or status")
	}
	if got := PublicMessage(err); got != "create sandbox: memory_mb: must be between 1 and 4096; ask for less" {
		t.Fatalf("PublicMessage = %q", got)
	}
}

func TestFromConnectKeepsConnectError(t *testing.T) {
	ce := connect.NewError(connect.CodeResourceExhausted, errors.New("node full"))
	err := FromConnect(fmt.Errorf("call node: %w", ce))
	if !errors.Is(err, ErrResourceExhausted) || err.Error() != "node full" {
		t.Fatalf("FromConnect = %v", err)
	}
	var got *connect.Error
	if !errors.As(err, &got) || got != ce {
		t.Fatal("the connect error is not kept as the cause")
	}
	// Unknown remote codes become internal, with the remote's message kept
	// (it is already public: no second "internal error" ref).
	err = FromConnect(connect.NewError(connect.CodeUnknown, errors.New("internal error (ref 1234abcd)")))
	if !errors.Is(err, ErrInternal) || PublicMessage(err) != "internal error (ref 1234abcd)" {
		t.Fatalf("unknown remote: %v / %q", err, PublicMessage(err))
	}
	plain := errors.New("not connect")
	if FromConnect(plain) != plain {
		t.Fatal("a non-Connect error must pass through")
	}
}

func TestToConnectSendsOnlyThePublicMessage(t *testing.T) {
	hostPath := "/sys/fs/cgroup/opendsec/abc/memory.max"
	for _, tc := range []struct {
		name   string
		err    error
		code   connect.Code
		public string // "" means the generic text with a ref
	}{
		{"uncategorized", fmt.Errorf("create sandbox: write %s: device busy", hostPath), connect.CodeUnknown, ""},
		{"internal", New(ErrInternal, "read %s: %w", hostPath, fs.ErrPermission), connect.CodeInternal, ""},
		{"with public", WithPublic(New(ErrUnavailable, "mount %s: busy", hostPath), "the sandbox's root could not be mounted; retry"), connect.CodeUnavailable, "the sandbox's root could not be mounted; retry"},
		{"categorized", New(ErrNotFound, "sandbox %q not found", "abc"), connect.CodeNotFound, `sandbox "abc" not found`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ce := new(connect.Error)
			if !errors.As(ToConnect(tc.err), &ce) {
				t.Fatal("ToConnect returned no connect error")
			}
			if ce.Code() != tc.code {
				t.Fatalf("code = %v, want %v", ce.Code(), tc.code)
			}
			msg := ce.Message()
			if tc.public == "" {
				if !strings.HasPrefix(msg, "internal error (ref ") || strings.Contains(msg, "/") {
					t.Fatalf("message = %q, want the generic one", msg)
				}
			} else if msg != tc.public {
				t.Fatalf("message = %q, want %q", msg, tc.public)
			}
			if tc.public != tc.err.Error() {
				detail, hidden := Detail(ce)
				if !hidden || detail != tc.err.Error() {
					t.Fatalf("Detail = %q, %v; want the full error for the log", detail, hidden)
				}
			}
			if !errors.Is(ce, tc.err) {
				t.Fatal("the answer must still wrap the error (for the log and errors.Is)")
			}
			status, hmsg := ToHTTP(t.Context(), tc.err)
			if status != statusOf(tc.code) || (tc.public != "" && hmsg != tc.public) || strings.Contains(hmsg, hostPath) {
				t.Fatalf("ToHTTP = %d %q", status, hmsg)
			}
		})
	}
	// A connect error is already an answer.
	ce := connect.NewError(connect.CodeNotFound, errors.New("gone"))
	if ToConnect(ce) != ce {
		t.Fatal("a connect error must pass through")
	}
}

func TestWithPublicKeepsCategoryAndCause(t *testing.T) {
	cause := &pathErr{path: "/var/lib/opendsec/images/x"}
	err := fmt.Errorf("import: %w", WithPublic(New(ErrFailedPrecondition, "unpack: %w", cause), "the image's layer could not be unpacked"))
	var pe *pathErr
	if !errors.As(err, &pe) || !errors.Is(err, ErrFailedPrecondition) || Code(err) != connect.CodeFailedPrecondition {
		t.Fatal("WithPublic lost the cause or the category")
	}
	if !strings.Contains(err.Error(), cause.path) {
		t.Fatal("Error() is the internal text and must keep the detail")
	}
	if PublicMessage(err) != "the image's layer could not be unpacked" {
		t.Fatalf("PublicMessage = %q", PublicMessage(err))
	}
	if WithPublic(nil, "x") != nil {
		t.Fatal("WithPublic(nil) must be nil")
	}
}

// TestSecuritySandboxDiedMetadata: a DiedError is answered failed_precondition
// with the reason in DiedMetadataKey; read back (FromConnect) it is a DiedError
// again, and re-answered it keeps the metadata (node -> apiserver -> SDK).
func TestSecuritySandboxDiedMetadata(t *testing.T) {
	err := fmt.Errorf("start process: %w", SandboxDied("sb1", "killed by signal 9"))
	ce := ToConnect(err).(*connect.Error)
	if ce.Code() != connect.CodeFailedPrecondition || ce.Meta().Get(DiedMetadataKey) != "killed by signal 9" ||
		ce.Message() != "start process: sandbox sb1 died: killed by signal 9; create a new one" {
		t.Fatalf("answer: %v meta %v", ce, ce.Meta())
	}
	back := FromConnect(ce)
	var de *DiedError
	if !errors.As(back, &de) || de.Reason != "killed by signal 9" || !errors.Is(back, ErrFailedPrecondition) {
		t.Fatalf("read back: %v (%T)", back, back)
	}
	again := ToConnect(fmt.Errorf("exec: %w", back)).(*connect.Error)
	if again.Meta().Get(DiedMetadataKey) != "killed by signal 9" {
		t.Fatalf("re-answered without the metadata: %v", again)
	}
	// Anything else carries none.
	if m := ToConnect(New(ErrFailedPrecondition, "sandbox x is paused")).(*connect.Error).Meta().Get(DiedMetadataKey); m != "" {
		t.Fatalf("paused answer has %s %q", DiedMetadataKey, m)
	}
}

// A node's "network policy turned off" refusal travels as metadata through
// each hop (node → apiserver → gateway), so callers test IsNetworkOff
// instead of matching its text; other invalid-argument answers are not it.
func TestNetworkOffMetadata(t *testing.T) {
	err := fmt.Errorf("create sandbox: %w", NetworkOff("n001"))
	ce := ToConnect(err).(*connect.Error)
	if ce.Code() != connect.CodeInvalidArgument || ce.Meta().Get(NetworkOffMetadataKey) != "n001" ||
		!strings.Contains(ce.Message(), "network: node n001 has network policy turned off") {
		t.Fatalf("answer: %v meta %v", ce, ce.Meta())
	}
	back := FromConnect(ce)
	if !IsNetworkOff(back) || !IsInvalidArgument(back) {
		t.Fatalf("read back: %v (%T) is not network-off invalid-argument", back, back)
	}
	again := FromConnect(ToConnect(fmt.Errorf("place: %w", back)))
	if !IsNetworkOff(again) {
		t.Fatalf("second hop lost the mark: %v", again)
	}
	text := FromConnect(ToConnect(Invalid("network", "node n001 has network policy turned off (node.network.enabled)")))
	if IsNetworkOff(text) {
		t.Fatal("an invalid-argument answer with the same text but no mark reads as network-off")
	}
}
