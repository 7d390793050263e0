// Package seccompbpf installs a compiled seccomp BPF program (the container
// backend writes it, see internal/runtime/container/seccomp_linux.go) on the
// calling process. It is shared by opendsec-init, which installs the filter
// before anything else runs in a sandbox, and opendsec-agent, which installs
// it when it is started on its own. It depends only on the standard
// library's smallest packages and golang.org/x/sys/unix, because
// opendsec-init must stay tiny.
package seccompbpf
