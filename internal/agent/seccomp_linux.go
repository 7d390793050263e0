package agent

import (
	"fmt"
	"os"
	"unsafe"

	"golang.org/x/sys/unix"
)

// InstallSeccompFilter installs the classic BPF seccomp program in path
// (struct sock_filter array, native endian, as the container backend writes
// it) on every thread of this process, after setting no_new_privs. Every
// process started afterwards inherits it and cannot remove it. It must run
// before the agent serves anything: from then on the agent itself is under
// the filter too. Any error leaves the caller to exit: a sandbox never runs
// without its filter.
func InstallSeccompFilter(path string) error {
	b, err := os.ReadFile(path)
	if err != nil {
		return fmt.Errorf("read seccomp filter: %w", err)
	}
	if len(b) == 0 || len(b)%8 != 0 || len(b)/8 > 4096 {
		return fmt.Errorf("seccomp filter %s: %d bytes is not 1 to 4096 8-byte instructions", path, len(b))
	}
	// unix.SockFilter has the kernel's layout (u16 code, u8 jt, u8 jf, u32 k).
	prog := make([]unix.SockFilter, len(b)/8)
	copy(unsafe.Slice((*byte)(unsafe.Pointer(&prog[0])), len(b)), b)
	fprog := unix.SockFprog{Len: uint16(len(prog)), Filter: &prog[0]}
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		return fmt.Errorf("set no_new_privs: %w", err)
	}
	// TSYNC: the Go runtime already runs several threads; all of them get
	// the filter, or none does (the call then returns the thread's id).
	r, _, errno := unix.Syscall(unix.SYS_SECCOMP, unix.SECCOMP_SET_MODE_FILTER,
		unix.SECCOMP_FILTER_FLAG_TSYNC, uintptr(unsafe.Pointer(&fprog)))
	if errno != 0 {
		return fmt.Errorf("install seccomp filter: %w", errno)
	}
	if r != 0 {
		return fmt.Errorf("install seccomp filter: thread %d could not be synchronised", r)
	}
	return nil
}
