package sched

import (
	"errors"
	"strings"
	"testing"
)

func TestDecideCore(t *testing.T) {
	for _, c := range []struct {
		name      string
		smt       string
		readErr   error
		kernelErr error
		on        bool
		reason    string
	}{
		{"smt on, kernel has it", "1\n", nil, nil, true, "SMT is on"},
		{"smt off", "0\n", nil, nil, false, "SMT is off"},
		{"smt off, no kernel support", "0\n", nil, errors.New("invalid argument"), false, "SMT is off"},
		{"smt on, no kernel support", "1\n", nil, errors.New("invalid argument"), false, "CONFIG_SCHED_CORE"},
		{"no smt file", "", errors.New("no such file"), nil, false, "no SMT information"},
	} {
		d := DecideCore(c.smt, c.readErr, c.kernelErr)
		if d.Enabled != c.on || !strings.Contains(d.Reason, c.reason) {
			t.Errorf("%s: got %+v, want enabled %v and a reason with %q", c.name, d, c.on, c.reason)
		}
	}
}
