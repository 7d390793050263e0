// Package envdsig signs and checks envd's file URLs (E2B's `/files` signed
// download and upload links), shared by the in-sandbox agent and the E2B
// gateway so both enforce exactly the same rules.
package envdsig

import (
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"net/http"
	"net/url"
	"strconv"
	"time"
)

// Sign is envd's file URL signature: "v1_" + unpadded base64 of
// SHA-256("<path>:<op>:<username>:<token>[:<expiration>]"), op "read" or
// "write", expiration in unix seconds or "" for none.
func Sign(path, op, username, token, expiration string) string {
	s := path + ":" + op + ":" + username + ":" + token
	if expiration != "" {
		s += ":" + expiration
	}
	sum := sha256.Sum256([]byte(s))
	return "v1_" + base64.RawStdEncoding.EncodeToString(sum[:])
}

// CheckQuery checks the signature and expiration in a /files query for op
// under token. It returns 0 when the request may pass, else the HTTP status
// and envd's exact message (e.g. "signature is already expired").
func CheckQuery(q url.Values, op, token string, now time.Time) (status int, msg string) {
	sig := q.Get("signature")
	if sig == "" {
		return http.StatusUnauthorized, "missing signature query parameter"
	}
	exp := q.Get("signature_expiration")
	if subtle.ConstantTimeCompare([]byte(sig), []byte(Sign(q.Get("path"), op, q.Get("username"), token, exp))) != 1 {
		return http.StatusUnauthorized, "invalid signature"
	}
	if exp != "" {
		n, err := strconv.ParseInt(exp, 10, 64)
		if err != nil {
			return http.StatusUnauthorized, "invalid signature expiration"
		}
		if n < now.Unix() {
			return http.StatusUnauthorized, "signature is already expired"
		}
	}
	return 0, ""
}
