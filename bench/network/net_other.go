//go:build !linux

package main

import (
	"context"
	"errors"
)

func kernelRelease() string { return "unknown" }

func run(context.Context, config) (*report, error) {
	return nil, errors.New("bench/network needs Linux (network namespaces, veths, nftables)")
}
