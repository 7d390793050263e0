//go:build !unix

package cli

// watchResize is a no-op where there is no SIGWINCH.
func watchResize(fd int, fn func(cols, rows uint32)) (stop func()) { return func() {} }
