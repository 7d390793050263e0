//go:build !linux

package main

import (
	"context"
	"errors"
)

func runcLoop(ctx context.Context, c config, r *result) error {
	return errors.New("the runc loop runs on Linux only")
}
