package daemon

// The backends this build can run register themselves (runtime.Register);
// the node config's backends section picks among them. Adding a backend
// to the build is one import here.
import (
	_ "github.com/kernflux/opendsec/internal/runtime/container" // "container": runc
	_ "github.com/kernflux/opendsec/internal/runtime/gvisor"    // "gvisor": runsc
	_ "github.com/kernflux/opendsec/internal/runtime/microvm"   // "microvm": Firecracker + jailer
	_ "github.com/kernflux/opendsec/internal/runtime/vm"        // "vm": QEMU
)
