//go:build !linux

package main

import "errors"

var errLinux = errors.New("the images benchmark runs on Linux only")

type disk struct{ name, stat string }

func diskOf(string) (disk, error)                      { return disk{}, errLinux }
func (disk) written() (int64, error)                   { return 0, errLinux }
func du(string) int64                                  { return 0 }
func treeBytes(string) int64                           { return 0 }
func freeBytes(string) (int64, error)                  { return 0, errLinux }
func cgroupMounts() (map[string]string, string, error) { return nil, "", errLinux }
func removeCgroup(map[string]string, string) error     { return errLinux }
func loadAvg() string                                  { return "unknown" }
func kernelRelease() string                            { return "unknown" }
