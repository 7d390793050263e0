// Command trajectory measures what the trajectory log costs an exec
// (bench/trajectory.sh): three nodes in this process, each over the fake
// backend but with a real opendsec agent (internal/agent) behind every
// sandbox, on a unix socket, running real processes: one node with the log
// off, one with it on, one with it on and fsync. Rounds interleave the
// three: an exec of -cmd through the node's agent proxy (the path every
// exec takes: apiserver → node → agent), start to exit, with a fresh call
// ID on the logged nodes. Then the replay of a recorded call (same call
// ID again: nothing runs). Medians and ratios go to -out.
//
// The round trip measured here is the node and agent part of an exec; a
// call through the apiserver adds its hop to both sides, so the log's
// share of a full exec is smaller than the ratio printed.
package main

import (
	"context"
	"flag"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"time"

	"connectrpc.com/connect"

	"github.com/kernflux/opendsec/api/gen/process"
	"github.com/kernflux/opendsec/api/gen/process/processconnect"
	"github.com/kernflux/opendsec/internal/agent"
	"github.com/kernflux/opendsec/internal/node"
	odrt "github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/runtime/runtimefake"
	"github.com/kernflux/opendsec/internal/sandboxid"
	"github.com/kernflux/opendsec/internal/sandboxspec"
	"github.com/kernflux/opendsec/internal/trajectory"
)

type images struct{ layer string }

func (i images) Hold(context.Context, string, string) (odrt.Image, error) {
	return odrt.Image{Rootfs: odrt.Rootfs{Image: "bench", Layers: []odrt.Layer{{Format: odrt.LayerDir, Path: i.layer}}}}, nil
}
func (images) Release(context.Context, string) error { return nil }

// agentRuntime is the fake backend whose agent connections go to a real
// agent's unix socket.
type agentRuntime struct {
	*runtimefake.Runtime
	sock string
}

func (r agentRuntime) AgentConn(ctx context.Context, _ string) (net.Conn, error) {
	var d net.Dialer
	return d.DialContext(ctx, "unix", r.sock)
}

type variant struct {
	name string
	srv  *httptest.Server
	id   string
	log  bool
	took []time.Duration
}

func main() {
	rounds := flag.Int("rounds", 300, "interleaved rounds")
	cmd := flag.String("cmd", "/bin/true", "the command each exec runs")
	out := flag.String("out", "", "also write the report here")
	command := flag.String("command", "bench/trajectory", "the command line, for the report")
	revision := flag.String("revision", "dev", "the revision, for the report")
	flag.Parse()
	if err := run(*rounds, *cmd, *out, *command, *revision); err != nil {
		fmt.Fprintln(os.Stderr, "trajectory:", err)
		os.Exit(1)
	}
}

func run(rounds int, cmd, out, command, revision string) error {
	ctx := context.Background()
	dir, err := os.MkdirTemp("", "odbench-traj")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	a, err := agent.New(ctx, agent.Config{})
	if err != nil {
		return fmt.Errorf("agent: %w", err)
	}
	defer a.Close()
	sock := filepath.Join(dir, "agent.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		return err
	}
	asrv := &http.Server{Handler: a.Handler()}
	go asrv.Serve(ln)
	defer asrv.Close()

	mk := func(name string, tc node.TrajectoryConfig) (*variant, func(), error) {
		rt := agentRuntime{Runtime: runtimefake.New(runtimefake.Config{StateRoot: "bench-" + sandboxid.New("fake")}), sock: sock}
		n, err := node.New(ctx, node.Config{
			ID: "b001", StateDir: filepath.Join(dir, name), Backends: map[string]odrt.Runtime{runtimefake.Name: rt},
			DefaultBackend: runtimefake.Name, Images: images{layer: dir}, CPU: 4, MemoryMB: 4096, Trajectory: tc,
		})
		if err != nil {
			return nil, nil, err
		}
		rec, err := n.Create(ctx, node.CreateRequest{ID: sandboxid.New("b001"), Spec: sandboxspec.Spec{Image: "bench", TimeoutSec: 3600}})
		if err != nil {
			n.Close()
			return nil, nil, err
		}
		srv := httptest.NewServer(n.AgentProxy())
		return &variant{name: name, srv: srv, id: rec.ID, log: !tc.Off}, func() {
			srv.Close()
			n.StopAll(context.Background(), "bench end")
			n.Close()
		}, nil
	}
	var vs []*variant
	for _, c := range []struct {
		name string
		tc   node.TrajectoryConfig
	}{
		{"log off", node.TrajectoryConfig{Off: true}},
		{"log on", node.TrajectoryConfig{}},
		{"log on, fsync", node.TrajectoryConfig{Sync: true}},
	} {
		v, done, err := mk(c.name, c.tc)
		if err != nil {
			return err
		}
		defer done()
		vs = append(vs, v)
	}
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 4}}
	execOnce := func(v *variant, callID string) (time.Duration, bool, error) {
		pc := processconnect.NewProcessClient(client, v.srv.URL+node.AgentPrefix+v.id)
		req := connect.NewRequest(&process.StartRequest{Process: &process.ProcessConfig{Cmd: "/bin/sh", Args: []string{"-c", cmd}}})
		if callID != "" {
			req.Header().Set(trajectory.CallIDHeader, callID)
		}
		t0 := time.Now()
		st, err := pc.Start(ctx, req)
		if err != nil {
			return 0, false, err
		}
		defer st.Close()
		ended, replayed := false, false
		for st.Receive() {
			replayed = st.ResponseHeader().Get(trajectory.ReplayedHeader) == "true"
			if st.Msg().GetEvent().GetEnd() != nil {
				ended = true
			}
		}
		d := time.Since(t0)
		if err := st.Err(); err != nil {
			return 0, false, err
		}
		if !ended {
			return 0, false, fmt.Errorf("%s: no end event", v.name)
		}
		return d, replayed, nil
	}
	// Warm up each path.
	for _, v := range vs {
		for i := range 20 {
			if _, _, err := execOnce(v, callIDFor(v, "warm", i)); err != nil {
				return err
			}
		}
	}
	for i := range rounds {
		// Rotate who goes first so no variant always follows another.
		for k := range vs {
			v := vs[(i+k)%len(vs)]
			d, _, err := execOnce(v, callIDFor(v, "r", i))
			if err != nil {
				return err
			}
			v.took = append(v.took, d)
		}
	}
	// Replays: every logged round's call ID again.
	var replays []time.Duration
	on := vs[1]
	for i := range rounds {
		d, replayed, err := execOnce(on, callIDFor(on, "r", i))
		if err != nil {
			return err
		}
		if !replayed {
			return fmt.Errorf("call r/%d was not replayed", i)
		}
		replays = append(replays, d)
	}
	var b strings.Builder
	fmt.Fprintf(&b, "# Trajectory log: exec round trip with the log on vs off (%s)\n\n", time.Now().UTC().Format("2006-01-02"))
	fmt.Fprintf(&b, "Command: `%s` (revision %s), %d interleaved rounds, %d cores, `%s` per exec.\n\n", command, revision, rounds, runtime.NumCPU(), cmd)
	b.WriteString("Each exec: `process.Process/Start` through the node's agent proxy to a real opendsec agent on a unix socket, start to exit event. ")
	b.WriteString("Logged execs carry a fresh call ID (recorded before the process starts, its end after). ")
	b.WriteString("The apiserver's hop, present in a real exec, is not in either side: the log's share of a full exec is lower than shown.\n\n")
	b.WriteString("| path | p50 | p90 | vs log off |\n|---|---|---|---|\n")
	base := pct(vs[0].took, 50)
	for _, v := range vs {
		p := pct(v.took, 50)
		fmt.Fprintf(&b, "| %s | %s | %s | %+.1f%% |\n", v.name, ms(p), ms(pct(v.took, 90)), 100*(float64(p)/float64(base)-1))
	}
	fmt.Fprintf(&b, "| replay of a recorded call (log on; nothing runs) | %s | %s | %+.1f%% |\n", ms(pct(replays, 50)), ms(pct(replays, 90)), 100*(float64(pct(replays, 50))/float64(base)-1))
	text := b.String()
	fmt.Print(text)
	if out != "" {
		return os.WriteFile(out, []byte(text), 0o644)
	}
	return nil
}

func callIDFor(v *variant, prefix string, i int) string {
	if !v.log {
		return ""
	}
	return fmt.Sprintf("%s/%d", prefix, i)
}

func pct(ds []time.Duration, p int) time.Duration {
	s := slices.Clone(ds)
	slices.Sort(s)
	if len(s) == 0 {
		return 0
	}
	return s[min(len(s)*p/100, len(s)-1)]
}

func ms(d time.Duration) string { return fmt.Sprintf("%.2f ms", float64(d.Microseconds())/1000) }
