// Package interpreter ships the code interpreter that E2B's code-interpreter
// SDKs call on port 49999: a stdlib-only Python program (interpreter.py)
// serving POST /execute and /contexts, with one persistent Python process per
// context. The container backend bind-mounts it read-only into every sandbox
// at PathInSandbox; the agent starts it on the first tunnel to Port.
package interpreter

import _ "embed"

// Source is the runner program.
//
//go:embed interpreter.py
var Source []byte

const (
	// Port is where the runner listens, on 127.0.0.1 inside the sandbox.
	Port = 49999
	// PathInSandbox is where the runner file is mounted in a sandbox.
	PathInSandbox = "/.opendsec/interpreter.py"
)
