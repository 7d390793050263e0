// Package cli implements the opendsecctl commands on top of the Go client
// (sdk/go). Main runs one command line and returns the process exit code.
package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os/signal"
	"syscall"

	"github.com/spf13/cobra"

	opendsec "github.com/kernflux/opendsec/sdk/go"
)

// exitError ends the command with a specific exit code and no message,
// e.g. the exit code of a process run with `sandbox exec`.
type exitError struct{ code int }

func (e *exitError) Error() string { return fmt.Sprintf("exit code %d", e.code) }

// usageError is a mistake on the command line.
type usageError struct{ msg string }

func (e *usageError) Error() string { return e.msg }

func usagef(format string, args ...any) error { return &usageError{msg: fmt.Sprintf(format, args...)} }

// app holds the global flags and the client built from them.
type app struct {
	endpoint string
	token    string
	output   string

	stdin  io.Reader
	stdout io.Writer
	stderr io.Writer

	client *opendsec.Client
}

// Main runs opendsecctl with args (without the program name) and returns
// the exit code: 0 on success, 1 on errors, or the exit code of the remote
// process for `sandbox exec`.
func Main(args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	a := &app{stdin: stdin, stdout: stdout, stderr: stderr}
	root := a.rootCommand()
	root.SetArgs(args)
	root.SetIn(stdin)
	root.SetOut(stdout)
	root.SetErr(stderr)
	err := root.ExecuteContext(ctx)
	if a.client != nil {
		a.client.Close()
	}
	return a.report(err)
}

// report prints err for people and returns the exit code.
func (a *app) report(err error) int {
	if err == nil {
		return 0
	}
	var ee *exitError
	if errors.As(err, &ee) {
		return ee.code
	}
	var ue *usageError
	if errors.As(err, &ue) {
		fmt.Fprintf(a.stderr, "error: %s\nrun 'opendsecctl --help' for usage\n", ue.msg)
		return 1
	}
	var oe *opendsec.Error
	if errors.As(err, &oe) {
		msg := oe.Message
		if msg == "" {
			msg = oe.Code.String()
		}
		fmt.Fprintf(a.stderr, "error: %s\n", msg)
		if h := a.hint(oe.Code); h != "" {
			fmt.Fprintf(a.stderr, "hint: %s\n", h)
		}
		return 1
	}
	fmt.Fprintf(a.stderr, "error: %s\n", err)
	return 1
}

// hint returns advice for common failures.
func (a *app) hint(code opendsec.Code) string {
	switch code {
	case opendsec.CodeUnauthenticated:
		return "set OPENDSEC_TOKEN (see /root/opendsec-ops/demo.env)"
	case opendsec.CodeUnavailable:
		return fmt.Sprintf("is `opendsec up` running at %s?", a.endpointForHint())
	case opendsec.CodePermissionDenied:
		return "the token's principal lacks a grant for this; ask a project admin"
	case opendsec.CodeResourceExhausted:
		return "a quota or the node capacity is used up; stop sandboxes you no longer need"
	}
	return ""
}

func (a *app) endpointForHint() string {
	if a.client != nil {
		return a.client.Endpoint()
	}
	if a.endpoint != "" {
		return a.endpoint
	}
	return "$" + opendsec.EnvEndpoint
}

func (a *app) rootCommand() *cobra.Command {
	root := &cobra.Command{
		Use:           "opendsecctl",
		Short:         "Command-line client for OpenDsec sandboxes",
		SilenceErrors: true,
		SilenceUsage:  true,
		PersistentPreRunE: func(cmd *cobra.Command, args []string) error {
			if a.output != "table" && a.output != "json" {
				return usagef("--output: %q is not a format; use table or json", a.output)
			}
			return nil
		},
	}
	root.SetFlagErrorFunc(func(cmd *cobra.Command, err error) error {
		return usagef("%s", err)
	})
	f := root.PersistentFlags()
	f.StringVar(&a.endpoint, "endpoint", "", "apiserver address, host:port or http(s)://host:port (default $OPENDSEC_ENDPOINT, else "+opendsec.DefaultEndpoint+")")
	f.StringVar(&a.token, "token", "", "bearer token (default $OPENDSEC_TOKEN)")
	f.StringVarP(&a.output, "output", "o", "table", "output format: table or json")

	sandbox := &cobra.Command{Use: "sandbox", Aliases: []string{"sb"}, Short: "Create, list, inspect, run commands in and stop sandboxes"}
	sandbox.AddCommand(a.createCommand(), a.prewarmCommand(), a.listCommand(), a.getCommand(), a.execCommand(), a.stopCommand(), a.setTimeoutCommand(), a.setNetworkCommand())
	sandbox.AddCommand(a.portForwardCommand(), a.packDiffCommand(), a.sandboxSnapshotCommand())
	sandbox.AddCommand(a.pauseCommand(), a.resumeCommand(), a.metricsCommand(), a.forkCommand(), a.logCommand())
	files := &cobra.Command{Use: "files", Short: "Copy files to and from sandboxes and list directories"}
	files.AddCommand(a.cpCommand(), a.lsCommand())
	root.AddCommand(sandbox, files, a.taskCommand(), a.imageCommand(), a.snapshotCommand(), a.versionCommand())
	return root
}

// connect builds the client from the global flags on first use.
func (a *app) connect() (*opendsec.Client, error) {
	if a.client != nil {
		return a.client, nil
	}
	var opts []opendsec.Option
	if a.token != "" {
		opts = append(opts, opendsec.WithToken(a.token))
	}
	c, err := opendsec.New(a.endpoint, opts...)
	if err != nil {
		return nil, err
	}
	a.client = c
	return c, nil
}
