package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"

	"github.com/spf13/cobra"
	"golang.org/x/term"

	opendsec "github.com/kernflux/opendsec/sdk/go"
)

func (a *app) execCommand() *cobra.Command {
	var (
		env                []string
		cwd, user, timeout string
		outputLimit        string
		callID             string
		tty, stdin         bool
	)
	cmd := &cobra.Command{
		Use:   "exec ID [flags] -- CMD [ARGS...]",
		Short: "Run a command in a sandbox, streaming its output; exits with its exit code",
		Example: `  opendsecctl sandbox exec n001sb0001 -- python3 -c 'print(6*7)'
  echo hello | opendsecctl sandbox exec n001sb0001 -i -- cat
  opendsecctl sandbox exec n001sb0001 -it -- /bin/sh`,
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) < 2 {
				return usagef("sandbox exec: give the sandbox ID and the command, e.g. exec ID -- ls -l /")
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			envMap, err := parseKV("env", env)
			if err != nil {
				return err
			}
			secs, err := parseSeconds("timeout", timeout)
			if err != nil {
				return err
			}
			limit, err := parseBytes("output-limit", outputLimit)
			if err != nil {
				return err
			}
			c, err := a.connect()
			if err != nil {
				return err
			}
			return a.exec(cmd.Context(), c, args[0], opendsec.ExecOptions{
				Command:     args[1:],
				Env:         envMap,
				Cwd:         cwd,
				User:        user,
				Stdin:       stdin,
				Timeout:     secondsDuration(secs),
				Stdout:      a.stdout,
				Stderr:      a.stderr,
				OutputLimit: limit,
				CallID:      callID,
			}, tty)
		},
	}
	f := cmd.Flags()
	f.StringArrayVarP(&env, "env", "e", nil, "environment variable KEY=VALUE (repeatable)")
	f.StringVarP(&cwd, "cwd", "w", "", "working directory")
	f.StringVarP(&user, "user", "u", "", "user to run as (default: the sandbox's)")
	f.BoolVarP(&tty, "tty", "t", false, "run on a terminal; puts the local terminal in raw mode and forwards its size")
	f.BoolVarP(&stdin, "stdin", "i", false, "forward standard input")
	f.StringVar(&timeout, "timeout", "", "kill the process after this long, e.g. 30s (default: no limit)")
	f.StringVar(&outputLimit, "output-limit", "", "write at most this many bytes of each of stdout and stderr, e.g. 16MiB; the rest is read and dropped (default: no limit; nothing is buffered)")
	f.StringVar(&callID, "call-id", "", "exactly-once: a call ID already in the sandbox's trajectory log prints the recorded result and runs nothing")
	return cmd
}

// cappedWriter writes the first limit bytes to w and counts the rest. It
// never fails, so the process's stream keeps draining.
type cappedWriter struct {
	w     io.Writer
	limit int64
	total int64
}

func (c *cappedWriter) Write(p []byte) (int, error) {
	room := c.limit - c.total
	c.total += int64(len(p))
	if room > 0 {
		_, _ = c.w.Write(p[:min(room, int64(len(p)))]) // a failing local writer must not stall the stream
	}
	return len(p), nil
}

// parseBytes reads a byte count: a plain number or one with a KiB, MiB or
// GiB suffix. Empty is 0.
func parseBytes(flag, s string) (int64, error) {
	if s == "" {
		return 0, nil
	}
	num, mult := s, int64(1)
	for suffix, m := range map[string]int64{"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30} {
		if n, ok := strings.CutSuffix(s, suffix); ok {
			num, mult = n, m
		}
	}
	n, err := strconv.ParseInt(num, 10, 64)
	if err != nil || n < 0 || n > (1<<62)/mult {
		return 0, usagef("--%s: %q is not a byte count; use e.g. 1048576, 512KiB, 16MiB or 1GiB", flag, s)
	}
	return n * mult, nil
}

// exec runs one process and returns an *exitError with its exit code.
func (a *app) exec(ctx context.Context, c *opendsec.Client, id string, opts opendsec.ExecOptions, tty bool) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()

	termFD := -1
	if f, ok := a.stdin.(*os.File); ok && term.IsTerminal(int(f.Fd())) {
		termFD = int(f.Fd())
	}
	if tty {
		opts.PTY = &opendsec.PtySize{Cols: 80, Rows: 24}
		if termFD >= 0 {
			if w, h, err := term.GetSize(termFD); err == nil {
				opts.PTY = &opendsec.PtySize{Cols: uint32(w), Rows: uint32(h)}
			}
		}
	}
	// The server enforces OutputLimit; the capped writers hold to it with
	// servers that do not.
	var capOut, capErr *cappedWriter
	if opts.OutputLimit > 0 {
		capOut, capErr = &cappedWriter{w: opts.Stdout, limit: opts.OutputLimit}, &cappedWriter{w: opts.Stderr, limit: opts.OutputLimit}
		opts.Stdout, opts.Stderr = capOut, capErr
	}
	p, err := c.Exec(ctx, id, opts)
	if err != nil {
		return err
	}
	if tty && termFD >= 0 {
		old, err := term.MakeRaw(termFD)
		if err != nil {
			cancel()
			_, _ = p.Wait()
			return fmt.Errorf("put terminal in raw mode: %w", err)
		}
		defer func() { _ = term.Restore(termFD, old) }() // nothing better to do at exit
		stopResize := watchResize(termFD, func(cols, rows uint32) { _ = p.Resize(cols, rows) })
		defer stopResize()
	}
	if !tty {
		// Ctrl-C interrupts the remote process; a second one gives up.
		sigc := make(chan os.Signal, 2)
		signal.Notify(sigc, os.Interrupt)
		defer signal.Stop(sigc)
		go func() {
			select {
			case <-sigc:
				_ = p.Signal(syscall.SIGINT)
			case <-p.Done():
				return
			}
			select {
			case <-sigc:
				cancel()
			case <-p.Done():
			}
		}()
	}
	if opts.Stdin {
		go forwardStdin(a.stdin, p)
	}
	st, err := p.Wait()
	if err != nil {
		return err
	}
	if st.TimedOut {
		fmt.Fprintf(a.stderr, "opendsecctl: process killed after --timeout\n")
	}
	if capOut != nil && (st.OutputTruncated || capOut.total > opts.OutputLimit || capErr.total > opts.OutputLimit) {
		fmt.Fprintf(a.stderr, "opendsecctl: output truncated at --output-limit %d: stdout %d bytes, stderr %d bytes produced\n",
			opts.OutputLimit, max(capOut.total, st.StdoutBytes), max(capErr.total, st.StderrBytes))
	} else if st.OutputTruncated {
		fmt.Fprintf(a.stderr, "opendsecctl: the server dropped some output\n")
	}
	if code := exitCode(st); code != 0 {
		return &exitError{code: code}
	}
	return nil
}

// forwardStdin copies r to the process's stdin and closes it at EOF.
func forwardStdin(r io.Reader, p *opendsec.Process) {
	buf := make([]byte, 32<<10)
	for {
		n, err := r.Read(buf)
		if n > 0 {
			if serr := p.SendStdin(buf[:n]); serr != nil {
				return
			}
		}
		if errors.Is(err, io.EOF) {
			_ = p.CloseStdin()
			return
		}
		if err != nil {
			return
		}
	}
}

var signalNumbers = map[string]int{
	"hangup": 1, "interrupt": 2, "quit": 3, "aborted": 6, "killed": 9,
	"segmentation fault": 11, "broken pipe": 13, "terminated": 15,
}

// exitCode maps the remote exit status to ours; a process killed by a
// signal gives 128+signal, as shells do.
func exitCode(st *opendsec.ExitStatus) int {
	if st.ExitCode >= 0 {
		return st.ExitCode
	}
	name, ok := strings.CutPrefix(st.Status, "signal: ")
	if ok {
		if n, err := strconv.Atoi(name); err == nil {
			return 128 + n
		}
		if n, found := signalNumbers[name]; found {
			return 128 + n
		}
	}
	return 255
}
