package container

import "testing"

// Nodes sharing a machine never share runc state or a cgroup parent: the
// defaults carry the node ID; configured values and a config without one
// (tests) keep theirs.
func TestSecurityTwoNodesDefaultsCarryTheNodeID(t *testing.T) {
	for _, c := range []struct {
		cfg          Config
		root, cgroup string
		legacy       bool
	}{
		{Config{}, "/run/opendsec/runc", "/opendsec", false},
		{Config{NodeID: "n001"}, "/run/opendsec/n001/runc", "/opendsec-n001", true},
		{Config{NodeID: "n002"}, "/run/opendsec/n002/runc", "/opendsec-n002", true},
		{Config{NodeID: "n002", StateRoot: "/srv/runc"}, "/srv/runc", "/opendsec-n002", false},
		{Config{NodeID: "n002", CgroupParent: "/x"}, "/run/opendsec/n002/runc", "/x", false},
	} {
		cfg := c.cfg
		cfg.setDefaults()
		if cfg.StateRoot != c.root || cfg.CgroupParent != c.cgroup || cfg.legacyDefaults != c.legacy {
			t.Errorf("%+v: state root %q, cgroup parent %q, legacy %v; want %q, %q, %v", c.cfg, cfg.StateRoot, cfg.CgroupParent, cfg.legacyDefaults, c.root, c.cgroup, c.legacy)
		}
	}
}
