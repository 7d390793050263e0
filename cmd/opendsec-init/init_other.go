//go:build !linux

package main

// run needs Linux (unix sockets handed down as fds, subreapers, seccomp).
func run(cfg config) int {
	logf("opendsec-init runs only on Linux")
	return 1
}
