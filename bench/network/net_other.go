//go:build !linux

package main

import (
	"context"
	"errors"
	"net"
)

func kernelRelease() string { return "unknown" }

func run(context.Context, config) (*report, error) {
	return nil, errors.New("bench/network needs Linux (network namespaces, veths, nftables)")
}

func dialInNS(string, string) (net.Conn, error) {
	return nil, errors.New("bench/network needs Linux to enter a network namespace")
}
