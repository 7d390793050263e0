package main

import (
	"slices"
	"strings"
	"testing"
)

func TestParseArgs(t *testing.T) {
	c, err := parseArgs([]string{"--seccomp-filter", "/f", "--listen", "/run/a.sock", "--", "/agent", "--x", "--"})
	if err != nil {
		t.Fatal(err)
	}
	if c.seccomp != "/f" || c.listen != "/run/a.sock" || !slices.Equal(c.server, []string{"/agent", "--x", "--"}) {
		t.Fatalf("parsed %+v", c)
	}
	c, err = parseArgs([]string{"--listen-fd", "3", "--env-file", "/run/e", "--own-env", "GOMAXPROCS=1", "--", "/agent"})
	if err != nil || c.fd != 3 || c.listen != "" || c.envFile != "/run/e" || c.ownEnv != "GOMAXPROCS=1" {
		t.Fatalf("parsed %+v, %v", c, err)
	}
	for _, tc := range []struct {
		args []string
		want string // in the error
	}{
		{[]string{"--", "/agent"}, "--listen"},
		{[]string{"--listen", "rel.sock", "--", "/agent"}, "not absolute"},
		{[]string{"--listen", "/a.sock"}, "server"},
		{[]string{"--listen", "/a.sock", "--"}, "server"},
		{[]string{"--listen"}, "--listen needs a value"},
		{[]string{"--seccomp-filter", "", "--listen", "/a", "--", "/x"}, "--seccomp-filter needs a value"},
		{[]string{"--bogus", "--listen", "/a", "--", "/x"}, "unknown argument --bogus"},
		{[]string{"--listen-fd", "x", "--", "/x"}, "not a file descriptor number"},
		{[]string{"--listen-fd", "3", "--env-file", "", "--", "/x"}, "--env-file needs a value"},
		{[]string{"--listen-fd", "2", "--", "/x"}, "not a file descriptor number"},
		{[]string{"--listen-fd", "3", "--listen", "/a", "--", "/x"}, "not both"},
		{[]string{"--listen-fd", "3", "--own-env", "GOMAXPROCS", "--", "/x"}, "is not K=V"},
		{[]string{"--listen-fd", "3", "--own-env", "", "--", "/x"}, "--own-env needs a value"},
	} {
		_, err := parseArgs(tc.args)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("parseArgs(%q) = %v; want an error containing %q", tc.args, err, tc.want)
		}
	}
}
