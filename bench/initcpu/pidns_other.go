//go:build !linux

package main

import "syscall"

// newPIDNS: PID namespaces are Linux's; elsewhere -pidns changes nothing.
func newPIDNS() *syscall.SysProcAttr { return nil }
