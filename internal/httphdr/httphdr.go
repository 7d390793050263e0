// Package httphdr reads HTTP header values made of comma-separated
// tokens (Connection, Upgrade, Expect), for the node's and the agent's
// tunnel and upgrade handling alike.
package httphdr

import (
	"net/http"
	"strings"
)

// HasToken says whether any value of header name in h lists token
// (comma-separated, spaces around an element ignored, case-insensitive):
// HasToken(h, "Connection", "upgrade") for "Connection: keep-alive, Upgrade".
func HasToken(h http.Header, name, token string) bool {
	for _, v := range h.Values(name) {
		for part := range strings.SplitSeq(v, ",") {
			if strings.EqualFold(strings.TrimSpace(part), token) {
				return true
			}
		}
	}
	return false
}
