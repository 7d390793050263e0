//go:build !linux

package main

import (
	"context"
	"errors"
	"time"
)

func runcLoop(ctx context.Context, c config, r *result) error {
	return errors.New("the runc loop runs on Linux only")
}

func fsInodesUsed(string) (int64, error) {
	return 0, errors.New("inode counts on Linux only")
}

func waitQuiet(context.Context, time.Duration) (time.Duration, int, error) {
	return 0, 0, nil
}
