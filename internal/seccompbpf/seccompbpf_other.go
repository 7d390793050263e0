//go:build !linux

package seccompbpf

import "errors"

// Install is only supported on Linux.
func Install(path string) error {
	return &Error{Op: "install seccomp filter", Err: errors.New("seccomp filters need Linux")}
}

// InstallProgram is only supported on Linux.
func InstallProgram(path string, b []byte) error {
	return &Error{Op: "install seccomp filter", Err: errors.New("seccomp filters need Linux")}
}
