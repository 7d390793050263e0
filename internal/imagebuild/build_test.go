package imagebuild

import (
	"context"
	"strings"
	"testing"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/image"
)

// noRunner fails the test if a step would run.
type noRunner struct{ t *testing.T }

func (r noRunner) Run(context.Context, RunSpec, func(context.Context, string) error) (int, error) {
	r.t.Fatal("a step ran, but the build should have been refused first")
	return 0, nil
}

// Bad requests and Dockerfiles are refused before any step runs or the
// store is touched, with an invalid_argument naming the field, line and
// instruction.
func TestBuildRefusesBadInputFirst(t *testing.T) {
	st, err := image.Open(t.TempDir(), image.WithFormat(image.FormatDir))
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		req  Request
		want []string
	}{
		{"bad name", Request{Name: "Bad Name", Dockerfile: []byte("FROM scratch\n")}, []string{"name:", "not valid"}},
		{"empty dockerfile", Request{Name: "a:b"}, []string{"dockerfile:", "empty"}},
		{"too big", Request{Name: "a:b", Dockerfile: make([]byte, MaxDockerfileBytes+1)}, []string{"dockerfile:", "bytes"}},
		{"no from", Request{Name: "a:b", Dockerfile: []byte("RUN true\n")}, []string{"dockerfile:", "line 1", "before the first FROM"}},
		{"unknown instruction", Request{Name: "a:b", Dockerfile: []byte("FROM scratch\nCOPY a /a\nFROBNICATE x\n")}, []string{"dockerfile:", "line 3", "unknown instruction: FROBNICATE"}},
		{"unsupported", Request{Name: "a:b", Dockerfile: []byte("FROM scratch\nVOLUME /data\n")}, []string{"line 2", "VOLUME is not supported"}},
		{"run mount", Request{Name: "a:b", Dockerfile: []byte("FROM scratch\nRUN --mount=type=cache,target=/c true\n")}, []string{"line 2", "RUN --mount"}},
		{"unknown target", Request{Name: "a:b", Target: "nope", Dockerfile: []byte("FROM scratch AS one\n")}, []string{"target:", "nope"}},
		{"unknown base", Request{Name: "a:b", Dockerfile: []byte("FROM team/none:1\n")}, []string{"line 1", "team/none:1", "no such image"}},
		{"run on scratch", Request{Name: "a:b", Dockerfile: []byte("FROM scratch\nRUN true\n")}, []string{"line 2", "FROM scratch has no files"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Build(t.Context(), st, noRunner{t}, tc.req, nil)
			if !errdefs.IsInvalidArgument(err) {
				t.Fatalf("err %v, want invalid_argument", err)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Fatalf("err %q lacks %q", err, w)
				}
			}
			if ls, err := st.LayerDigests(); err != nil || len(ls) != 0 {
				t.Fatalf("layers %v %v after a refused build", ls, err)
			}
		})
	}
}

// A config-only build on scratch runs nothing (ENV expands ARGs and build
// args, a stage builds on another) and is refused at the end: an image
// needs files. The store is unchanged.
func TestBuildConfigOnlyOnScratchIsRefused(t *testing.T) {
	st, err := image.Open(t.TempDir(), image.WithFormat(image.FormatDir))
	if err != nil {
		t.Fatal(err)
	}
	df := "ARG V=1\nFROM scratch AS base\nARG V\nARG W=dflt\nENV A=$V B=${W}x\nCMD [\"x\"]\nFROM base\nUSER 1000\nLABEL k=v\nEXPOSE 80 53/udp\nENTRYPOINT /bin/app\n"
	var steps []string
	_, err = Build(t.Context(), st, noRunner{t}, Request{Name: "t/c:1", Dockerfile: []byte(df), BuildArgs: map[string]string{"W": "set"}}, func(e Event) {
		if e.Done {
			steps = append(steps, e.Instruction)
		}
	})
	if !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), "the image has no files") {
		t.Fatalf("build: %v; want the no-files refusal", err)
	}
	if len(steps) != 10 || steps[3] != "ENV A=$V B=${W}x" {
		t.Fatalf("steps %q; want the 10 steps as written", steps)
	}
	if imgs, _ := st.List(t.Context()); len(imgs) != 0 {
		t.Fatalf("images %v after a refused build", imgs)
	}
}
