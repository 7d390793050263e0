//go:build !linux

package main

import (
	"context"
	"errors"
	"fmt"
)

type report struct{}

func (r *report) String() string { return fmt.Sprintln("bench/pause runs on Linux only") }

func run(context.Context, config) (*report, error) {
	return nil, errors.New("bench/pause runs on Linux only (cgroups, swap)")
}
