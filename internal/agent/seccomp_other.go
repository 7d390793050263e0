//go:build !linux

package agent

import "errors"

// InstallSeccompFilter is only supported on Linux.
func InstallSeccompFilter(path string) error {
	return errors.New("seccomp filters need Linux")
}
