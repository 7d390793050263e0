package httphdr

import (
	"net/http"
	"testing"
)

func TestHasToken(t *testing.T) {
	h := http.Header{}
	h.Add("Connection", "keep-alive, Upgrade")
	h.Add("Upgrade", "websocket")
	h.Add("Upgrade", " TCP ")
	for _, tc := range []struct {
		name, token string
		want        bool
	}{
		{"Connection", "upgrade", true},
		{"connection", "keep-alive", true},
		{"Upgrade", "tcp", true}, // in the second value, padded, other case
		{"Upgrade", "h2c", false},
		{"Connection", "keep", false}, // a part of an element is no token
		{"Expect", "100-continue", false},
	} {
		if got := HasToken(h, tc.name, tc.token); got != tc.want {
			t.Errorf("HasToken(%s, %s) = %v; want %v", tc.name, tc.token, got, tc.want)
		}
	}
}
