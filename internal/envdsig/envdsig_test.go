package envdsig

import (
	"net/url"
	"strconv"
	"testing"
	"time"
)

func TestCheckQuery(t *testing.T) {
	now := time.Unix(1_800_000_000, 0)
	future, past := strconv.FormatInt(now.Unix()+60, 10), strconv.FormatInt(now.Unix()-1, 10)
	q := func(sig, exp string) url.Values {
		v := url.Values{"path": {"/a"}, "username": {"user"}, "signature": {sig}}
		if exp != "" {
			v.Set("signature_expiration", exp)
		}
		return v
	}
	cases := []struct {
		name string
		q    url.Values
		op   string
		want string
	}{
		{"valid", q(Sign("/a", "read", "user", "tok", ""), ""), "read", ""},
		{"valid until", q(Sign("/a", "read", "user", "tok", future), future), "read", ""},
		{"missing", q("", ""), "read", "missing signature query parameter"},
		{"wrong op", q(Sign("/a", "read", "user", "tok", ""), ""), "write", "invalid signature"},
		{"wrong token", q(Sign("/a", "read", "user", "other", ""), ""), "read", "invalid signature"},
		{"expired", q(Sign("/a", "read", "user", "tok", past), past), "read", "signature is already expired"},
	}
	for _, c := range cases {
		status, msg := CheckQuery(c.q, c.op, "tok", now)
		if msg != c.want || (c.want == "") != (status == 0) {
			t.Errorf("%s: got %d %q, want %q", c.name, status, msg, c.want)
		}
	}
}
