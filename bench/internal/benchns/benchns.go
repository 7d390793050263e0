//go:build linux

// Package benchns runs benchmark code inside network namespaces.
package benchns

import (
	"fmt"
	goruntime "runtime"

	"github.com/vishvananda/netns"
)

// In runs fn with the calling goroutine's thread in the network namespace
// bind-mounted at path, then moves the thread back. Sockets fn opens stay
// in that namespace.
func In(path string, fn func() error) error {
	goruntime.LockOSThread()
	defer goruntime.UnlockOSThread()
	orig, err := netns.Get()
	if err != nil {
		return fmt.Errorf("get netns: %w", err)
	}
	defer orig.Close()
	ns, err := netns.GetFromPath(path)
	if err != nil {
		return fmt.Errorf("open netns %s: %w", path, err)
	}
	defer ns.Close()
	if err := netns.Set(ns); err != nil {
		return fmt.Errorf("enter netns %s: %w", path, err)
	}
	ferr := fn()
	if err := netns.Set(orig); err != nil {
		panic("restore network namespace: " + err.Error()) // the thread is unusable
	}
	return ferr
}
