//go:build !linux

package main

func slowSysmon() {}
