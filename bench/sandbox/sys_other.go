//go:build !linux

package main

import "errors"

var errLinuxOnly = errors.New("the sandbox benchmark runs on Linux only")

func mountOverlay(lower, upper, work, target string) error { return errLinuxOnly }

func unmount(target string) error { return errLinuxOnly }

type cgroupInfo struct {
	v2     bool
	mode   string
	mounts map[string]string
	memory string
}

func detectCgroups() (cgroupInfo, error) { return cgroupInfo{}, errLinuxOnly }

func (ci cgroupInfo) removeAll(path string) error { return errLinuxOnly }

func kernelRelease() string { return "unknown" }

func (ci cgroupInfo) freeze(path string, frozen bool) error { return errLinuxOnly }
