//go:build unix

package cli

import (
	"os"
	"os/signal"
	"syscall"

	"golang.org/x/term"
)

// watchResize calls fn with the terminal's new size on every SIGWINCH until
// the returned stop function is called.
func watchResize(fd int, fn func(cols, rows uint32)) (stop func()) {
	sigc := make(chan os.Signal, 1)
	signal.Notify(sigc, syscall.SIGWINCH)
	done := make(chan struct{})
	go func() {
		for {
			select {
			case <-done:
				return
			case <-sigc:
				if w, h, err := term.GetSize(fd); err == nil {
					fn(uint32(w), uint32(h))
				}
			}
		}
	}()
	return func() {
		signal.Stop(sigc)
		close(done)
	}
}
