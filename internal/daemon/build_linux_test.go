package daemon

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kernflux/opendsec/internal/image"
	opendsec "github.com/kernflux/opendsec/sdk/go"
)

// buildRecord collects a build's events.
type buildRecord struct {
	cached, ran []string // instructions of layer steps, by outcome
	logs        strings.Builder
}

func (r *buildRecord) progress(e *opendsec.BuildEvent) {
	if s := e.GetStep(); s != nil && s.GetDone() && isLayerStep(s.GetInstruction()) {
		if s.GetCached() {
			r.cached = append(r.cached, s.GetInstruction())
		} else {
			r.ran = append(r.ran, s.GetInstruction())
		}
	}
	if l := e.GetLog(); l != nil {
		r.logs.Write(l.GetData())
	}
}

// isLayerStep: the instruction makes a layer (the others only change the
// config and are never cached).
func isLayerStep(instr string) bool {
	for _, p := range []string{"RUN ", "COPY ", "ADD ", "WORKDIR "} {
		if strings.HasPrefix(instr, p) {
			return true
		}
	}
	return false
}

func writeFiles(t *testing.T, dir string, files map[string]string) {
	t.Helper()
	for name, body := range files {
		p := filepath.Join(dir, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

const multiStageDockerfile = `ARG BASE=root/busybox
FROM ${BASE} AS builder
ARG GREETING=hello
ENV BUILD_ENV=b1
WORKDIR /src
COPY data/ ./data/
RUN echo ran-builder && echo "$GREETING $BUILD_ENV" > out.txt && cat data/a.txt >> out.txt

FROM root/busybox
LABEL team=rl
EXPOSE 8080
ARG FLAVOR=plain
ENV APP_HOME=/opt/app FLAVOR=${FLAVOR}-x
WORKDIR /opt/app
COPY --from=builder /src/out.txt ./out.txt
COPY app.sh /usr/local/bin/app
RUN echo ran-final && chmod 755 /usr/local/bin/app && mkdir -p /home/user && chown 1000:1000 /home/user
USER user
RUN echo "uid=$(id -u)"
CMD ["/usr/local/bin/app"]
`

// TestBuildImageMultiStage: opendsecctl's and the SDKs' build path (upload
// the context, build on the node) builds a multi-stage Dockerfile with
// ARG, ENV, WORKDIR, COPY, COPY --from, RUN and USER into an image whose
// sandboxes see its files and config; a second build reuses every layer,
// and after one changed context file the steps before its COPY come from
// the cache (their RUN does not run again) and the ones after run. No
// build sandbox is left behind.
func TestBuildImageMultiStage(t *testing.T) {
	s := startOwnerSystem(t)
	defer s.stopAll(t)
	ctx := t.Context()
	dir := t.TempDir()
	writeFiles(t, dir, map[string]string{
		"Dockerfile": multiStageDockerfile,
		"data/a.txt": "from-a\n",
		"data/b.txt": "from-b\n",
		"app.sh":     "#!/bin/sh\necho app-v1 \"$APP_HOME\"\n",
	})
	build := func(args map[string]string) (*opendsec.Image, *buildRecord, time.Duration) {
		t.Helper()
		rec := &buildRecord{}
		t0 := time.Now()
		img, err := s.admin.BuildImage(ctx, "team/app:v1", &opendsec.BuildOptions{ContextDir: dir, BuildArgs: args, Progress: rec.progress})
		if err != nil {
			t.Fatalf("build: %v\nlogs:\n%s", err, rec.logs.String())
		}
		return img, rec, time.Since(t0)
	}
	img, first, d1 := build(map[string]string{"GREETING": "hi"})
	if cfg := img.GetConfig(); cfg.GetUser() != "user" || cfg.GetWorkdir() != "/opt/app" || !slices.Contains(cfg.GetEnv(), "APP_HOME=/opt/app") || !slices.Contains(cfg.GetEnv(), "FLAVOR=plain-x") ||
		slices.Contains(cfg.GetEnv(), "BUILD_ENV=b1") || !slices.Equal(cfg.GetCmd(), []string{"/usr/local/bin/app"}) ||
		cfg.GetLabels()["team"] != "rl" || !slices.Contains(cfg.GetExposedPorts(), "8080/tcp") {
		t.Fatalf("image config %v", cfg)
	}
	if len(first.cached) != 0 || !strings.Contains(first.logs.String(), "ran-builder") || !strings.Contains(first.logs.String(), "uid=1000") {
		t.Fatalf("first build: cached %q, logs:\n%s", first.cached, first.logs.String())
	}
	sb, err := s.admin.CreateSandbox(ctx, &opendsec.SandboxSpec{Image: "team/app:v1", TimeoutSeconds: 120})
	if err != nil {
		t.Fatal(err)
	}
	res, err := s.admin.RunShell(ctx, sb.GetId(), `cat out.txt; pwd; id -u; /usr/local/bin/app; ls /src 2>&1`)
	if err != nil {
		t.Fatal(err)
	}
	want := "hi b1\nfrom-a\n/opt/app\n1000\napp-v1 /opt/app\n"
	if !strings.HasPrefix(string(res.Stdout), want) || !strings.Contains(string(res.Stdout)+string(res.Stderr), "No such file") {
		t.Fatalf("in the built image: stdout %q stderr %q; want prefix %q and no /src (builder stage only)", res.Stdout, res.Stderr, want)
	}
	if err := s.admin.StopSandbox(ctx, sb.GetId()); err != nil {
		t.Fatal(err)
	}

	img2, second, d2 := build(map[string]string{"GREETING": "hi"})
	if img2.GetId() != img.GetId() || len(second.ran) != 0 || strings.Contains(second.logs.String(), "ran-") {
		t.Fatalf("unchanged rebuild: id %s vs %s, ran %q, logs %q", img2.GetId(), img.GetId(), second.ran, second.logs.String())
	}
	writeFiles(t, dir, map[string]string{"app.sh": "#!/bin/sh\necho app-v2\n"})
	img3, third, d3 := build(map[string]string{"GREETING": "hi"})
	logs := third.logs.String()
	if strings.Contains(logs, "ran-builder") || !strings.Contains(logs, "ran-final") {
		t.Fatalf("after changing app.sh, the builder's RUN ran again or the final RUN did not: logs %q", logs)
	}
	for _, want := range []string{"COPY data/ ./data/", "COPY --from=builder /src/out.txt ./out.txt"} {
		if !slices.Contains(third.cached, want) {
			t.Fatalf("step %q not from the cache: cached %q ran %q", want, third.cached, third.ran)
		}
	}
	if !slices.Contains(third.ran, "COPY app.sh /usr/local/bin/app") {
		t.Fatalf("changed COPY did not run: ran %q", third.ran)
	}
	l1, l3 := img.GetLayers(), img3.GetLayers()
	// busybox, WORKDIR /opt/app, COPY --from, COPY app.sh, RUN chmod; the
	// last RUN changes no file (its sandbox's own mount points are not
	// kept), so it adds no layer.
	if len(l1) != 5 || len(l3) != 5 {
		t.Fatalf("layers: first %v, after the change %v; want 5 (a RUN that changes nothing adds none)", l1, l3)
	}
	if l1[2].GetDigest() != l3[2].GetDigest() || l1[3].GetDigest() == l3[3].GetDigest() {
		t.Fatalf("layers: first %v, after the change %v; want the layers under COPY app.sh shared and the rest new", l1, l3)
	}
	t.Logf("build times: first %s, unchanged %s, one changed step %s", d1.Round(time.Millisecond), d2.Round(time.Millisecond), d3.Round(time.Millisecond))
	if out := os.Getenv("OPENDSEC_BUILD_BENCH_OUT"); out != "" {
		line := d1.Round(time.Millisecond).String() + " " + d2.Round(time.Millisecond).String() + " " + d3.Round(time.Millisecond).String() + "\n"
		f, err := os.OpenFile(out, os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
		if err == nil {
			f.WriteString(line)
			f.Close()
		}
	}
	assertNoSandboxes(t, s)
}

func assertNoSandboxes(t *testing.T, s *ownerSystem) {
	t.Helper()
	list, err := s.admin.ListSandboxes(context.WithoutCancel(t.Context()), opendsec.ListFilter{})
	if err != nil {
		t.Fatal(err)
	}
	if len(list) != 0 {
		t.Fatalf("sandboxes left behind: %v", ids(list))
	}
}

// TestBuildImageBadInput: an unknown instruction, a COPY from outside the
// context, a step that never ends (build timeout) and a failing step each
// fail with a clear error naming the line, instruction or timeout (the
// failing step's output in it), and leave the store as it was: the same
// layers and images, nothing staged, no sandbox.
func TestBuildImageBadInput(t *testing.T) {
	s := startOwnerSystem(t)
	defer s.stopAll(t)
	ctx := t.Context()
	store, err := image.Open(s.cfg.Node.ImageDir)
	if err != nil {
		t.Fatal(err)
	}
	before, err := store.LayerDigests()
	if err != nil {
		t.Fatal(err)
	}
	imgsBefore, err := s.admin.ListImages(ctx)
	if err != nil {
		t.Fatal(err)
	}
	parent := t.TempDir()
	dir := filepath.Join(parent, "ctx")
	writeFiles(t, parent, map[string]string{"secret": "s3cret", "ctx/ok.txt": "ok"})
	if err := os.Symlink(filepath.Join(parent, "secret"), filepath.Join(dir, "leak")); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, dockerfile string
		timeout          time.Duration
		code             opendsec.Code
		want             []string
	}{
		{"unknown instruction", "FROM root/busybox\nRUN echo one > /one\nFROBNICATE now\n", 0, opendsec.CodeInvalidArgument,
			[]string{"dockerfile", "line 3", "FROBNICATE"}},
		{"copy outside context", "FROM root/busybox\nRUN echo one > /one\nCOPY ../secret /secret\n", 0, opendsec.CodeInvalidArgument,
			[]string{"line 3", "../secret", "outside the build context"}},
		{"copy through a symlink out of the context", "FROM root/busybox\nCOPY leak /leak\n", 0, opendsec.CodeInvalidArgument,
			[]string{"line 2", "leak: no such file or directory in the build context"}},
		{"never-ending step", "FROM root/busybox\nRUN echo one > /one\nRUN echo started && sleep 100000\n", 3 * time.Second, opendsec.CodeDeadlineExceeded,
			[]string{"timed out after 3s", "RUN echo started", "started"}},
		{"failing step", "FROM root/busybox\nCOPY ok.txt /ok.txt\nRUN echo boom >&2; exit 3\n", 0, opendsec.CodeInvalidArgument,
			[]string{"line 3", "exited with code 3", "boom"}},
		{"unsupported instruction", "FROM root/busybox\nHEALTHCHECK CMD true\n", 0, opendsec.CodeInvalidArgument,
			[]string{"line 2", "HEALTHCHECK is not supported"}},
		{"unknown base", "FROM nope/missing:1\nRUN true\n", 0, opendsec.CodeInvalidArgument,
			[]string{"line 1", "nope/missing:1"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t0 := time.Now()
			_, err := s.admin.BuildImage(ctx, "team/bad:v1", &opendsec.BuildOptions{Dockerfile: tc.dockerfile, ContextDir: dir, Timeout: tc.timeout})
			if opendsec.CodeOf(err) != tc.code || !containsAll(err.Error(), tc.want...) {
				t.Fatalf("build: %v (code %s); want code %s with %q", err, opendsec.CodeOf(err), tc.code, tc.want)
			}
			if tc.timeout > 0 && time.Since(t0) > tc.timeout+30*time.Second {
				t.Fatalf("the timed-out build took %s", time.Since(t0))
			}
			after, err := store.LayerDigests()
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(before, after) {
				t.Fatalf("layers changed: before %v after %v", before, after)
			}
			imgs, err := s.admin.ListImages(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if len(imgs) != len(imgsBefore) {
				t.Fatalf("images changed: %d before, %d after", len(imgsBefore), len(imgs))
			}
			tmp, _ := os.ReadDir(filepath.Join(s.cfg.Node.ImageDir, "tmp"))
			if len(tmp) != 0 {
				t.Fatalf("build left staging behind: %v", tmp)
			}
			assertNoSandboxes(t, s)
		})
	}
}
