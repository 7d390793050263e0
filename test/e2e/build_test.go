//go:build linux

package e2e

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"connectrpc.com/connect"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
)

// TestImageBuildCLI: `opendsecctl image build -f FILE -t NAME DIR` against
// real `opendsec up` uploads DIR, shows each step with a progress bar and
// the RUN output, and prints the image; sandboxes of it see the files.
// Run again, every layer step says (cached); a bad Dockerfile fails with
// exit 1 and the line.
func TestImageBuildCLI(t *testing.T) {
	s := newSystem(t)
	s.Start()
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "hello.txt"), []byte("hello from the context\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	df := filepath.Join(t.TempDir(), "Build.dockerfile")
	if err := os.WriteFile(df, []byte("FROM root/busybox\nCOPY hello.txt /srv/hello.txt\nRUN echo step-output && cp /srv/hello.txt /srv/copy.txt\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	out, errOut, code := s.ctl(t, "image", "build", "-f", df, "-t", "team/cli:v1", dir)
	if code != 0 || !strings.Contains(out, "team/cli:v1") {
		t.Fatalf("build: exit %d\nstdout %s\nstderr %s", code, out, errOut)
	}
	for _, want := range []string{"] 1/3 FROM root/busybox", "] 2/3 COPY hello.txt /srv/hello.txt", "    | step-output", "[====================] 3/3 RUN echo step-output"} {
		if !strings.Contains(errOut, want) {
			t.Fatalf("progress on stderr lacks %q:\n%s", want, errOut)
		}
	}
	sb := s.Create(t, &opendsecv1.SandboxSpec{Image: "team/cli:v1"})
	if r := s.Shell(t, sb.GetId(), "cat /srv/copy.txt"); r.Stdout != "hello from the context\n" {
		t.Fatalf("in the built image: %q %q", r.Stdout, r.Stderr)
	}
	if _, err := s.Sandboxes().StopSandbox(t.Context(), connect.NewRequest(&opendsecv1.StopSandboxRequest{Id: sb.GetId()})); err != nil {
		t.Fatal(err)
	}
	out2, errOut2, code := s.ctl(t, "image", "build", "-f", df, "-t", "team/cli:v1", dir)
	if code != 0 || strings.Count(errOut2, "(cached)") != 2 || strings.Contains(errOut2, "| step-output") {
		t.Fatalf("rebuild: exit %d, want both layer steps cached\nstdout %s\nstderr %s", code, out2, errOut2)
	}
	bad := filepath.Join(t.TempDir(), "Dockerfile")
	if err := os.WriteFile(bad, []byte("FROM root/busybox\nFROBNICATE now\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	_, errOut3, code := s.ctl(t, "image", "build", "-f", bad, "-t", "team/cli:v2", dir)
	if code != 1 || !strings.Contains(errOut3, "line 2") || !strings.Contains(errOut3, "FROBNICATE") {
		t.Fatalf("bad Dockerfile: exit %d, stderr %s", code, errOut3)
	}
}
