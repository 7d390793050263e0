package vmchan

import (
	"io"
	"os"
)

func openPort(path string) (io.ReadWriteCloser, error) { return os.OpenFile(path, os.O_RDWR, 0) }
