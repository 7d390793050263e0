package e2b

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"net/http"
	"testing"
	"testing/iotest"
)

func envelope(flags byte, msg string) []byte {
	b := make([]byte, 5, 5+len(msg))
	b[0] = flags
	binary.BigEndian.PutUint32(b[1:], uint32(len(msg)))
	return append(b, msg...)
}

func guarded(body []byte, contentType string) io.Reader {
	return guardedGone(body, contentType, func(string) bool { panic("gone asked for a stream without an error") })
}

func guardedGone(body []byte, contentType string, gone func(string) bool) io.Reader {
	resp := &http.Response{StatusCode: http.StatusOK, Header: http.Header{"Content-Type": {contentType}}, Body: io.NopCloser(bytes.NewReader(body))}
	guardConnectStream(resp, gone)
	// One byte a read: envelopes split anywhere.
	return iotest.OneByteReader(resp.Body)
}

func TestConnectStreamCutIsAnError(t *testing.T) {
	full := append(append(envelope(0, "start"), envelope(0, "data")...), envelope(2, "{}")...)
	if b, err := io.ReadAll(guarded(full, "application/connect+proto")); err != nil || !bytes.Equal(b, full) {
		t.Fatalf("complete stream: %d bytes, %v", len(b), err)
	}
	for name, cut := range map[string][]byte{
		"between envelopes": full[:len(envelope(0, "start"))],
		"in a header":       full[:len(envelope(0, "start"))+3],
		"in a message":      full[:len(envelope(0, "start"))+7],
		"in the end":        full[:len(full)-1],
		"empty":             nil,
	} {
		b, err := io.ReadAll(guarded(cut, "application/connect+json"))
		// Whole messages pass; a partial header or end message is held.
		if !errors.Is(err, errStreamCut) || !bytes.HasPrefix(cut, b) || len(cut)-len(b) > 5 && name != "in the end" {
			t.Errorf("%s: %d of %d bytes, %v; want the messages, then errStreamCut", name, len(b), len(cut), err)
		}
	}
	// Not a Connect stream: left alone.
	if _, err := io.ReadAll(guarded([]byte("partial"), "application/json")); err != nil {
		t.Fatalf("unary response: %v", err)
	}
}

func TestConnectStreamErrorEndOfAGoneSandbox(t *testing.T) {
	errEnd := envelope(2, `{"error":{"code":"invalid_argument","message":"protocol error: incomplete envelope: unexpected EOF"}}`)
	body := append(envelope(0, "start"), errEnd...)
	var asked string
	b, err := io.ReadAll(guardedGone(body, "application/connect+proto", func(e string) bool { asked = e; return true }))
	if !errors.Is(err, errStreamCut) || !bytes.Equal(b, envelope(0, "start")) {
		t.Fatalf("gone sandbox: %q, %v; want the messages, then errStreamCut", b, err)
	}
	if asked != "invalid_argument: protocol error: incomplete envelope: unexpected EOF" {
		t.Fatalf("gone asked with %q", asked)
	}
	b, err = io.ReadAll(guardedGone(body, "application/connect+proto", func(string) bool { return false }))
	if err != nil || !bytes.Equal(b, body) {
		t.Fatalf("running sandbox: %q, %v; want the stream with its error end", b, err)
	}
}
