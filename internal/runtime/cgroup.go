package runtime

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// cgroupRoot is where the host's cgroup filesystems are mounted.
const cgroupRoot = "/sys/fs/cgroup"

// CgroupMemory is the memory the cgroup at path (relative to the cgroup
// root) is charged: memory.current on cgroup v2, memory.usage_in_bytes
// of the v1 memory controller; 0 when the cgroup is gone or unreadable.
// The vm and gvisor backends' reclaim reports it before and after.
func CgroupMemory(path string) int64 { return cgroupMemoryAt(cgroupRoot, path) }

func cgroupMemoryAt(root, path string) int64 {
	for _, f := range []string{
		filepath.Join(root, path, "memory.current"),
		filepath.Join(root, "memory", path, "memory.usage_in_bytes"),
	} {
		if b, err := os.ReadFile(f); err == nil {
			n, _ := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
			return n
		}
	}
	return 0
}
