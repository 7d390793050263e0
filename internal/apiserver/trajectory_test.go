package apiserver

import (
	"strings"
	"testing"

	"github.com/kernflux/opendsec/internal/trajectory"
)

// TestTrajectoryEntryOfCode: a code call's entry has its code, language,
// context, env, the interpreter's status, its result lines in stdout and
// its error in code_error.
func TestTrajectoryEntryOfCode(t *testing.T) {
	lines := `{"type": "stdout", "text": "42\n"}` + "\n"
	e := TrajectoryEntryOf(&trajectory.Call{
		Seq: 3, CallID: "r/1", State: trajectory.StateDone,
		Req:        trajectory.Request{Kind: trajectory.KindCode, Code: "1/0", Language: "python", Env: map[string]string{"A": "1"}},
		HTTPStatus: 200, End: true, Status: "error", ExitErr: "ZeroDivisionError: division by zero",
		Output: []trajectory.Chunk{{Stream: trajectory.Stdout, Data: []byte(lines)}},
	})
	if e.GetKind() != "code" || e.GetCode() != "1/0" || e.GetLanguage() != "python" || e.GetEnv()["A"] != "1" ||
		e.GetHttpStatus() != 200 || e.GetStatus() != "error" || e.GetCodeError() != "ZeroDivisionError: division by zero" ||
		string(e.GetStdout()) != lines {
		t.Fatalf("entry %v", e)
	}
	refused := TrajectoryEntryOf(&trajectory.Call{
		Seq: 4, State: trajectory.StateDone, Req: trajectory.Request{Kind: trajectory.KindCode, Code: "x", ContextID: "nope"},
		HTTPStatus: 404, Body: []byte("Context nope not found"),
	})
	if refused.GetContextId() != "nope" || refused.GetHttpStatus() != 404 || !strings.Contains(string(refused.GetStdout()), "not found") || refused.GetCodeError() != "" {
		t.Fatalf("refused entry %v", refused)
	}
}
