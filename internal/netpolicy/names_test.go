package netpolicy

import (
	"strings"
	"testing"

	"github.com/kernflux/opendsec/internal/errdefs"
)

// Everything a node makes on the host carries its node ID; without one the
// names are those of before.
func TestSecurityTwoNodesNamesCarryTheNodeID(t *testing.T) {
	for _, c := range []struct{ node, table, netns, ifPrefix string }{
		{"", "opendsec", "/run/opendsec/netns", "od"},
		{"n001", "opendsec-n001", "/run/opendsec/n001/netns", "odn001"},
		{"zz99", "opendsec-zz99", "/run/opendsec/zz99/netns", "odzz99"},
	} {
		if got := TableName(c.node); got != c.table {
			t.Errorf("TableName(%q) = %q, want %q", c.node, got, c.table)
		}
		if got := (Config{NodeID: c.node}).withDefaults("/data").NetNSDir; got != c.netns {
			t.Errorf("default netns_dir of %q = %q, want %q", c.node, got, c.netns)
		}
		id := c.node + "abcdefghijklmnop"
		name := HostIfName(c.node, id)
		if len(name) != 15 || !strings.HasPrefix(name, c.ifPrefix) || strings.Trim(name, "abcdefghijklmnopqrstuvwxyz0123456789") != "" {
			t.Errorf("HostIfName(%q, %q) = %q: want 15 characters of [a-z0-9] starting %q", c.node, id, name, c.ifPrefix)
		}
	}
	if HostIfName("aaaa", "aaaa1") == HostIfName("bbbb", "aaaa1") {
		t.Error("two nodes give one sandbox ID the same veth name")
	}
	if (Config{NodeID: "n001", NetNSDir: "/x"}).withDefaults("/data").NetNSDir != "/x" {
		t.Error("a configured netns_dir was replaced")
	}
	err := (Config{NodeID: "N-1"}).withDefaults("/data").Validate()
	if !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), "node.id") {
		t.Errorf("node ID %q: %v, want invalid node.id", "N-1", err)
	}
}
