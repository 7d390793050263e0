package main

import "syscall"

// newPIDNS starts a process as PID 1 of a new PID namespace.
func newPIDNS() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWPID}
}
