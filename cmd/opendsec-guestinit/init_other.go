//go:build !linux

package main

func run() int {
	logf("the guest init runs only on Linux")
	return 1
}
