//go:build !linux

package vmchan

import (
	"errors"
	"io"
)

func openPort(string) (io.ReadWriteCloser, error) {
	return nil, errors.New("vmchan: virtio-serial ports exist only in a Linux guest")
}
