// Package agent is opendsec-agent, the daemon that runs inside every sandbox
// (in containers started on demand by opendsec-init, PID 1, and exiting when
// idle: see Agent.Busy and docs/agent.md). It speaks E2B's envd wire
// protocol: Connect RPC services process.Process and filesystem.Filesystem
// with the JSON codec, and
// plain HTTP /health, /files and /envs. It also serves an internal port tunnel
// (/_opendsec/port/{port}) the node uses to reach servers inside the sandbox.
//
// Process output is never written to disk: every process's pipes are drained
// continuously into a bounded in-memory log, and slow clients lose the oldest
// output (with a marker) instead of growing the agent's memory.
package agent
