//go:build !linux

package sched

import (
	"errors"
	"os/exec"
)

var errNotLinux = errors.New("scheduling classes need Linux")

// SetIdle needs Linux.
func SetIdle(int) error { return errNotLinux }

// SetIdleAll needs Linux.
func SetIdleAll(func() ([]int, error)) error { return errNotLinux }

// StartIdle needs Linux.
func StartIdle(*exec.Cmd) error { return errNotLinux }

// StartOptions say what a command started with Start runs with.
type StartOptions struct{ Idle, Cookie bool }

// Start starts cmd; only without options off Linux.
func Start(cmd *exec.Cmd, o StartOptions) error {
	if o.Idle || o.Cookie {
		return errNotLinux
	}
	return cmd.Start()
}

// CreateCookie needs Linux.
func CreateCookie(int) error { return errNotLinux }

// Core is off off Linux.
func Core() CoreDecision { return CoreDecision{Reason: "core scheduling needs Linux"} }
