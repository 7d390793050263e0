// Command trajtrainer is the trainer of test/e2e's trajectory tests: it
// runs a rollout's steps in a sandbox with call IDs <rollout>/<step>
// through the Go SDK and prints one JSON line per finished step, so the
// test can kill it (-9) at a known point and run it again.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"

	opendsec "github.com/kernflux/opendsec/sdk/go"
)

// Step is one printed line.
type Step struct {
	Step     int    `json:"step"`
	Stdout   string `json:"stdout"`
	Exit     int    `json:"exit"`
	Replayed bool   `json:"replayed"`
	Seq      uint64 `json:"seq"`
}

// Command is step i of every rollout: steps 5 and 15 append a line to a
// file (non-idempotent), the others print.
func Command(i int) string {
	if i == 5 || i == 15 {
		return fmt.Sprintf("echo append-%d >> /tmp/appends; wc -l < /tmp/appends", i)
	}
	return fmt.Sprintf("echo step %d", i)
}

func main() {
	endpoint := flag.String("endpoint", "", "apiserver URL")
	token := flag.String("token", "", "bearer token")
	id := flag.String("sandbox", "", "sandbox ID")
	rollout := flag.String("rollout", "r1", "rollout ID (call ID prefix)")
	steps := flag.Int("steps", 20, "steps in the rollout")
	stopAfter := flag.Int("stop-after", 0, "exit 0 after this many steps (0: all)")
	flag.Parse()
	c, err := opendsec.New(*endpoint, opendsec.WithToken(*token))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	enc := json.NewEncoder(os.Stdout)
	for i := range *steps {
		if *stopAfter > 0 && i == *stopAfter {
			return
		}
		r, err := c.RunShell(context.Background(), *id, Command(i), opendsec.WithCallID(fmt.Sprintf("%s/%d", *rollout, i)))
		if err != nil {
			fmt.Fprintf(os.Stderr, "step %d: %v\n", i, err)
			os.Exit(1)
		}
		_ = enc.Encode(Step{Step: i, Stdout: r.Stdout, Exit: r.ExitCode, Replayed: r.Replayed, Seq: r.Seq})
	}
}
