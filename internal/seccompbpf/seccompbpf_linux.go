package seccompbpf

import (
	"errors"
	"os"
	"strconv"
	"unsafe"

	"golang.org/x/sys/unix"
)

// maxInstructions is the kernel's BPF_MAXINSNS.
const maxInstructions = 4096

// Install installs the classic BPF seccomp program in path (struct
// sock_filter array, native endian, as the container backend writes it) on
// every thread of this process, after setting no_new_privs. Every process
// started afterwards inherits it and cannot remove it. It must run before
// the process serves or starts anything. Any error leaves the caller to
// exit: a sandbox never runs without its filter.
func Install(path string) error {
	b, err := os.ReadFile(path)
	if err != nil {
		return &Error{Op: "read seccomp filter", Err: err}
	}
	return InstallProgram(path, b)
}

// InstallProgram is Install for a program already read from path (named in
// errors): opendsec-init reads it without package os, whose first open
// starts the runtime's network poller.
func InstallProgram(path string, b []byte) error {
	if len(b) == 0 || len(b)%8 != 0 || len(b)/8 > maxInstructions {
		return &Error{Op: "seccomp filter " + path, Err: errors.New(strconv.Itoa(len(b)) + " bytes is not 1 to 4096 8-byte instructions")}
	}
	// unix.SockFilter has the kernel's layout (u16 code, u8 jt, u8 jf, u32 k).
	prog := make([]unix.SockFilter, len(b)/8)
	copy(unsafe.Slice((*byte)(unsafe.Pointer(&prog[0])), len(b)), b)
	fprog := unix.SockFprog{Len: uint16(len(prog)), Filter: &prog[0]}
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		return &Error{Op: "set no_new_privs", Err: err}
	}
	// TSYNC: the Go runtime already runs several threads; all of them get
	// the filter, or none does (the call then returns the thread's id).
	r, _, errno := unix.Syscall(unix.SYS_SECCOMP, unix.SECCOMP_SET_MODE_FILTER,
		unix.SECCOMP_FILTER_FLAG_TSYNC, uintptr(unsafe.Pointer(&fprog)))
	if errno != 0 {
		return &Error{Op: "install seccomp filter", Err: errno}
	}
	if r != 0 {
		return &Error{Op: "install seccomp filter", Err: errors.New("thread " + strconv.Itoa(int(r)) + " could not be synchronised")}
	}
	return nil
}
