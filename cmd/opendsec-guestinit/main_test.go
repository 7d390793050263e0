package main

import "testing"

func TestParseCmdline(t *testing.T) {
	a := parseCmdline("console=ttyS0 quiet opendsec.layers=2 opendsec.rw=vdc opendsec.ip=10.0.0.2/24 opendsec.hostname=sb1 opendsec.flag")
	want := map[string]string{"layers": "2", "rw": "vdc", "ip": "10.0.0.2/24", "hostname": "sb1"}
	if len(a) != len(want) {
		t.Fatalf("got %v, want %v", a, want)
	}
	for k, v := range want {
		if a[k] != v {
			t.Errorf("%s = %q, want %q", k, a[k], v)
		}
	}
}
