//go:build !linux

package main

import (
	"context"
	"errors"
)

func run(context.Context, config) (*report, error) {
	return nil, errors.New("bench/security needs Linux (network namespaces, cgroups)")
}

func machine() string { return "not linux" }
