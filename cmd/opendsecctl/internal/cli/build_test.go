package cli

import (
	"bytes"
	"testing"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
)

// buildProgress prints one bar line per finished step, and a RUN step's
// output indented under a line naming the step.
func TestBuildProgress(t *testing.T) {
	var out bytes.Buffer
	p := buildProgress(&out)
	step := func(i int32, instr string, done, cached bool, ms int64) {
		p(&opendsecv1.BuildImageResponse{Event: &opendsecv1.BuildImageResponse_Step{Step: &opendsecv1.BuildStep{
			Index: i, Total: 2, Instruction: instr, Done: done, Cached: cached, DurationMs: ms}}})
	}
	step(1, "COPY a /a", false, false, 0)
	step(1, "COPY a /a", true, true, 0)
	step(2, "RUN make", false, false, 0)
	p(&opendsecv1.BuildImageResponse{Event: &opendsecv1.BuildImageResponse_Log{Log: &opendsecv1.BuildLog{Step: 2, Data: []byte("one\ntw")}}})
	p(&opendsecv1.BuildImageResponse{Event: &opendsecv1.BuildImageResponse_Log{Log: &opendsecv1.BuildLog{Step: 2, Data: []byte("o\n")}}})
	step(2, "RUN make", true, false, 1500)
	want := "[==========          ] 1/2 COPY a /a (cached)\n" +
		"[==========          ] 1/2 RUN make\n" +
		"    | one\n    | two\n" +
		"[====================] 2/2 RUN make (1.5s)\n"
	if out.String() != want {
		t.Fatalf("got\n%s\nwant\n%s", out.String(), want)
	}
}
