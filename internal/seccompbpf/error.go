package seccompbpf

// Error is an installation failure: what was being done and why it failed.
// (A type rather than fmt.Errorf: fmt would grow opendsec-init.)
type Error struct {
	Op  string
	Err error
}

func (e *Error) Error() string { return e.Op + ": " + e.Err.Error() }

// Unwrap returns the cause.
func (e *Error) Unwrap() error { return e.Err }
