// Command initcpu measures the CPU that opendsec-init (and the agent it
// starts) spend answering one request on a fresh socket: what each container
// sandbox pays in-sandbox from init's exec until its first answer. Each
// round starts init with a listening socket as fd 3 (as the node does), sends
// one request, reads the answer to EOF, sends SIGTERM and takes the CPU time
// (user + system, init and every child it reaped) from wait4's rusage.
// Variants run interleaved, round by round, so noise hits all alike.
//
//	go run ./bench/initcpu -n 300 -path /health \
//	  -variant before=/tmp/old/opendsec-init:/tmp/old/opendsec-agent \
//	  -variant after=bin/opendsec-init:bin/opendsec-agent
//
// Not a sandbox: no namespaces but a PID one (-pidns, as root: init is PID
// 1 there, as in a sandbox) and no cgroup; -seccomp PATH installs that
// compiled filter first, as in a sandbox. Run it on a quiet machine. -path
// /health is what the node asks after every create; -path /envs is a first
// real request (it starts the agent). A variant may add environment
// entries for init after its paths: NAME=INIT:AGENT,K=V,K=V; one written
// +K=V is init's own (first in its environment and passed as --own-env,
// as the node runs init with +GOMAXPROCS=1).
package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"maps"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"
)

type variant struct {
	name, init, agent string
	env               []string // added to init's environment
	own               string   // init's own first entry (--own-env); empty: none
	cpuMS, wallMS     []float64
	threads           []int // init's threads once idle after the answer
}

type variants []*variant

func (v *variants) String() string { return "" }

func (v *variants) Set(s string) error {
	name, rest, ok := strings.Cut(s, "=")
	f := strings.Split(rest, ",")
	initPath, agent, ok2 := strings.Cut(f[0], ":")
	if !ok || !ok2 || name == "" || initPath == "" || agent == "" {
		return fmt.Errorf("%q: give NAME=INIT:AGENT[,K=V...]", s)
	}
	nv := &variant{name: name, init: initPath, agent: agent}
	for _, e := range f[1:] {
		own, isOwn := strings.CutPrefix(e, "+")
		switch {
		case !strings.Contains(own, "="):
			return fmt.Errorf("%q: %q is not K=V", s, e)
		case isOwn && nv.own != "":
			return fmt.Errorf("%q: one +K=V at most", s)
		case isOwn:
			nv.own = own
		default:
			nv.env = append(nv.env, e)
		}
	}
	*v = append(*v, nv)
	return nil
}

func main() {
	var vs variants
	flag.Var(&vs, "variant", "NAME=INIT:AGENT (repeat it)")
	n := flag.Int("n", 200, "rounds")
	path := flag.String("path", "/health", "the request's path")
	flag.BoolVar(&pidns, "pidns", false, "run init as PID 1 of a new PID namespace (root)")
	flag.StringVar(&seccomp, "seccomp", "", "compiled seccomp filter init installs first (--seccomp-filter)")
	flag.Parse()
	if len(vs) == 0 {
		fmt.Fprintln(os.Stderr, "initcpu: -variant: give at least one NAME=INIT:AGENT")
		os.Exit(2)
	}
	dir, err := os.MkdirTemp("", "initcpu")
	if err != nil {
		fmt.Fprintln(os.Stderr, "initcpu:", err)
		os.Exit(1)
	}
	defer os.RemoveAll(dir)
	for i := range *n {
		for _, v := range vs {
			cpu, wall, threads, err := round(v, filepath.Join(dir, fmt.Sprint(i, ".sock")), *path)
			if err != nil {
				fmt.Fprintf(os.Stderr, "initcpu: %s: %v\n", v.name, err)
				os.Exit(1)
			}
			v.cpuMS, v.wallMS, v.threads = append(v.cpuMS, cpu), append(v.wallMS, wall), append(v.threads, threads)
		}
	}
	fmt.Printf("GET %s, %d rounds each, interleaved, pidns %v, seccomp %q\n\n| variant | CPU mean | CPU p50 | answer (wall) p50 | threads once idle (rounds) |\n|---|---|---|---|---|\n", *path, *n, pidns, seccomp)
	for _, v := range vs {
		fmt.Printf("| %s | %.2f ms | %.2f ms | %.2f ms | %s |\n", v.name, mean(v.cpuMS), p50(v.cpuMS), p50(v.wallMS), histogram(v.threads))
	}
}

var (
	pidns   bool
	seccomp string
)

// round runs v once and returns its CPU, the wall time to the answer, and
// init's threads once it is idle after the answer.
func round(v *variant, sock, path string) (cpuMS, wallMS float64, threads int, err error) {
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		return 0, 0, 0, err
	}
	lf, err := ln.File()
	ln.SetUnlinkOnClose(false) // lf keeps it listening
	ln.Close()
	if err != nil {
		return 0, 0, 0, err
	}
	defer os.Remove(sock)
	c, err := net.Dial("unix", sock)
	if err != nil {
		lf.Close()
		return 0, 0, 0, err
	}
	defer c.Close()
	t0 := time.Now()
	args := []string{"--listen-fd", "3", "--", v.agent, "--log-level", "warn"}
	if seccomp != "" {
		args = append([]string{"--seccomp-filter", seccomp}, args...)
	}
	cmd := exec.Command(v.init, args...)
	cmd.Env = append(os.Environ(), v.env...)
	if v.own != "" {
		cmd.Args = append([]string{v.init, "--own-env", v.own}, args...)
		cmd.Env = append([]string{v.own}, cmd.Env...)
	}
	cmd.ExtraFiles = []*os.File{lf}
	if pidns {
		cmd.SysProcAttr = newPIDNS()
	}
	cmd.Stderr = os.Stderr
	err = cmd.Start()
	lf.Close()
	if err != nil {
		return 0, 0, 0, err
	}
	defer func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		if werr := cmd.Wait(); werr != nil && err == nil {
			var ee *exec.ExitError
			if !errors.As(werr, &ee) {
				err = werr
			}
		}
		if ru, ok := cmd.ProcessState.SysUsage().(*syscall.Rusage); ok {
			cpuMS = float64(ru.Utime.Nano()+ru.Stime.Nano()) / 1e6
		}
	}()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.Write([]byte("GET " + path + " HTTP/1.1\r\nHost: agent\r\nConnection: close\r\n\r\n")); err != nil {
		return 0, 0, 0, err
	}
	b, err := io.ReadAll(c)
	if err != nil || !strings.HasPrefix(string(b), "HTTP/1.") {
		return 0, 0, 0, fmt.Errorf("answer %q: %v", b, err)
	}
	wallMS = float64(time.Since(t0).Microseconds()) / 1000
	return 0, wallMS, idleThreads(cmd.Process.Pid), nil
}

// histogram is "N×count, ..." of xs, by count.
func histogram(xs []int) string {
	m := map[int]int{}
	for _, x := range xs {
		m[x]++
	}
	var out []string
	for _, k := range slices.Sorted(maps.Keys(m)) {
		out = append(out, fmt.Sprintf("%d: %d", k, m[k]))
	}
	return strings.Join(out, ", ")
}

func mean(xs []float64) float64 {
	var s float64
	for _, x := range xs {
		s += x
	}
	return s / float64(len(xs))
}

func p50(xs []float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	return s[len(s)/2]
}
