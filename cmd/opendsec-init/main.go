// Command opendsec-init is the PID 1 of every container sandbox. It is tiny
// on purpose: an idle sandbox runs only this process. It installs the
// sandbox's seccomp filter, takes the agent's listening unix socket (made by
// the node and inherited, or created here), reaps every orphan, and starts
// the agent server (opendsec-agent) on demand. While no server runs, init
// accepts the next connection itself: a GET /health it answers as the
// agent would (the node asks for it after every create, and no agent need
// start for that); any other request starts the server, which gets the
// connection untouched. The server exits after an idle spell (--idle-exit)
// and is started again by the next request; connections queue in the
// kernel meanwhile.
//
// Usage:
//
//	opendsec-init [--seccomp-filter PATH] (--listen PATH | --listen-fd N) [--env-file PATH] [--own-env K=V] -- SERVER [ARGS...]
//
// With --listen-fd the socket is already bound and listening (the node
// makes it before the container starts, so connections queue from the
// first instant); with --listen init makes it. When the --env-file exists
// at boot (a sandbox prestarted for the node's warm pool gets its caller's
// environment only when it is let run), its NUL-separated K=V entries are
// the server's environment instead of init's own, and the file is removed.
// --own-env K=V says that init's environment starts with that entry, set
// for init alone (the node gives it GOMAXPROCS=1: the Go runtime reads it
// before main): the server's environment, init's own, is the rest.
//
// SERVER gets ARGS plus "--listen-fd 3 --conn-fd 4 --ready-fd 5": the
// listening socket, the connection that made init start it (to serve
// first), and a pipe on which it writes one byte once it serves. A server
// that dies before that byte gets init's 503 written to that connection,
// with how it ended; /health answers the same until a server serves. It
// depends only on the standard library's smallest packages and
// golang.org/x/sys/unix (see deps_test.go): no net/http, no protobuf, no
// fmt.
//
// Init is one goroutine and one wait (poller, init_linux.go): an epoll set
// of the listening socket (while no server runs), a connection it reads
// the start of, a server's ready pipe and an eventfd its signal handler
// writes, waited on through the Go runtime's poller, with the runtime's
// timers for backoff and deadlines. Signals (SIGCHLD, SIGTERM, SIGINT and
// the ones that would end the runtime) reach a few instructions of
// assembly of init's own (catchSignals, sig_handler_linux.go; os/signal on
// other architectures) instead of os/signal, which costs three threads for
// the process's life. Every thread on the host costs each later container
// create (crun's pivot_root walks them all): an idle init has three (the
// one asleep in the runtime's epoll_pwait, sysmon, and the idle one the
// runtime's own start leaves, sometimes two), where it had 6 or 7
// (bench/results/2026-12-06-init-threads.md).
package main

import (
	"errors"
	"os"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// config is what the command line says.
type config struct {
	seccomp string   // seccomp BPF program to install first; empty: none
	listen  string   // unix socket path to create and hand to the server
	fd      int      // inherited listening socket; -1: none (use listen)
	envFile string   // NUL-separated K=V entries for the server, read once and removed; empty: none
	ownEnv  string   // the first entry of init's environment when it is init's alone; empty: none
	server  []string // server argv (without --listen-fd)
}

// Respawn backoff after a server that fails at start.
const (
	minBackoff = 100 * time.Millisecond
	maxBackoff = 10 * time.Second
	// startWindow: a server that exits non-zero sooner than this after its
	// start counts as failing to start.
	startWindow = 5 * time.Second
)

const usage = "usage: opendsec-init [--seccomp-filter PATH] (--listen PATH | --listen-fd N) [--env-file PATH] [--own-env K=V] -- SERVER [ARGS...]"

func main() {
	cfg, err := parseArgs(os.Args[1:])
	if err != nil {
		logf(err.Error() + "\n" + usage)
		os.Exit(2)
	}
	os.Exit(run(cfg))
}

func parseArgs(args []string) (config, error) {
	c := config{fd: -1}
	for i := 0; i < len(args); i++ {
		a := args[i]
		switch a {
		case "--":
			c.server = args[i+1:]
			i = len(args)
		case "--seccomp-filter", "--listen", "--listen-fd", "--env-file", "--own-env":
			if i+1 >= len(args) || args[i+1] == "" {
				return c, errors.New(a + " needs a value")
			}
			switch a {
			case "--listen":
				c.listen = args[i+1]
			case "--env-file":
				c.envFile = args[i+1]
			case "--own-env":
				if !strings.Contains(args[i+1], "=") {
					return c, errors.New("--own-env: " + args[i+1] + " is not K=V")
				}
				c.ownEnv = args[i+1]
			case "--listen-fd":
				n, err := strconv.Atoi(args[i+1])
				if err != nil || n < 3 {
					return c, errors.New("--listen-fd: " + args[i+1] + " is not a file descriptor number of 3 or more")
				}
				c.fd = n
			default:
				c.seccomp = args[i+1]
			}
			i++
		case "-h", "--help":
			return c, errors.New("help requested")
		default:
			return c, errors.New("unknown argument " + a + "; put the server's command after --")
		}
	}
	switch {
	case c.listen != "" && c.fd >= 0:
		return c, errors.New("--listen and --listen-fd: give one, not both")
	case c.listen == "" && c.fd < 0:
		return c, errors.New("--listen: missing; give the unix socket path the node dials (or --listen-fd)")
	case c.fd < 0 && c.listen[0] != '/':
		return c, errors.New("--listen: " + c.listen + " is not absolute; give an absolute socket path")
	case len(c.server) == 0 || c.server[0] == "":
		return c, errors.New("server: missing; give its command after --, e.g. -- /.opendsec/agent")
	}
	return c, nil
}

// logf writes one line to stderr (the sandbox's agent log). A plain
// write(2): os.Stderr would turn an EPIPE into the runtime's SIGPIPE exit.
func logf(msg string) {
	_, _ = syscall.Write(2, []byte("opendsec-init: "+msg+"\n"))
}
