package e2b

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"connectrpc.com/connect"

	v1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/log"
	"github.com/kernflux/opendsec/internal/trajectory"
)

// sandboxLogEntry is E2B's SandboxLogEntry.
type sandboxLogEntry struct {
	Timestamp time.Time         `json:"timestamp"`
	Level     string            `json:"level"`
	Message   string            `json:"message"`
	Fields    map[string]string `json:"fields"`
}

// maxSandboxLogLimit bounds one page of sandbox logs (E2B's default).
const maxSandboxLogLimit = 1000

// maxTrajectoryCalls bounds the calls of one sandbox's log read for its
// logs; older ones are left out past it.
const maxTrajectoryCalls = 50000

// maxLoggedCommand bounds the command shown in a log message.
const maxLoggedCommand = 1024

// TrajectoryAPI is the part of OpenDsec's process service that reads a
// sandbox's trajectory log; opendsecv1connect.ProcessServiceClient
// satisfies it.
type TrajectoryAPI interface {
	GetTrajectory(context.Context, *connect.Request[v1.GetTrajectoryRequest]) (*connect.ServerStreamForClient[v1.TrajectoryEntry], error)
}

// readTrajectory reads the calls of sandbox id's trajectory log without
// their output, as the caller in ctx. ok is false when there is none to
// read (the API cannot serve it, or the node keeps no log).
func (g *Gateway) readTrajectory(ctx context.Context, id string) (calls []*v1.TrajectoryEntry, ok bool, err error) {
	if g.trajectory != nil {
		return g.trajectory(ctx, id)
	}
	if g.cfg.Trajectory == nil {
		return nil, false, nil
	}
	st, err := g.cfg.Trajectory.GetTrajectory(ctx, connect.NewRequest(&v1.GetTrajectoryRequest{SandboxId: id, WithoutOutput: true}))
	if err == nil {
		defer st.Close()
		for st.Receive() {
			calls = append(calls, st.Msg())
			if len(calls) > maxTrajectoryCalls {
				calls = calls[1:]
			}
		}
		err = st.Err()
	}
	if err != nil {
		err = errdefs.FromConnect(err)
		if errors.Is(err, errdefs.ErrFailedPrecondition) || errors.Is(err, errdefs.ErrUnimplemented) || errdefs.IsNotFound(err) {
			return nil, false, nil
		}
		return nil, false, fmt.Errorf("read trajectory log: %w", err)
	}
	return calls, true, nil
}

// sandboxLogs is GET /sandboxes/{id}/logs?start=&limit= (E2B's
// SandboxLogs {logs: [{timestamp, line}], logEntries}) and, with v2, GET
// /v2/sandboxes/{id}/logs?cursor=&limit=&direction=&level=&search= (E2B's
// SandboxLogsV2Response {logs: SandboxLogEntry[]}). The log is what the
// node knows of the sandbox: its start, and from its trajectory log each
// call made in it (commands, code runs, file uploads: what ran, as whom,
// where, when it began and how it ended; never the output). An unknown,
// killed or another principal's sandbox is 404.
func (g *Gateway) sandboxLogs(v2 bool) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		cursorName := "start"
		if v2 {
			cursorName = "cursor"
		}
		cursor, err := queryInt(r, cursorName, -1, 0, 1<<53)
		if err != nil {
			writeErr(w, err)
			return
		}
		limit, err := queryInt(r, "limit", maxSandboxLogLimit, 0, maxSandboxLogLimit)
		if err != nil {
			writeErr(w, err)
			return
		}
		dir, level, search := "forward", "debug", ""
		if v2 {
			if dir, err = queryEnum(r, "direction", "forward", "forward", "backward"); err == nil {
				level, err = queryEnum(r, "level", "debug", logLevels...)
			}
			if err != nil {
				writeErr(w, err)
				return
			}
			search = r.URL.Query().Get("search")
		}
		sb, err := g.lookup(r.Context(), sandboxID(r))
		if err != nil {
			writeErr(w, err)
			return
		}
		entries := []sandboxLogEntry{startEntry(sb)}
		calls, ok, err := g.readTrajectory(r.Context(), sb.GetId())
		if err != nil {
			// The sandbox is there; its call log could not be read now.
			log.G(r.Context()).Warn("e2b: sandbox logs", log.SandboxID(sb.GetId()), log.Err(err))
			entries = append(entries, sandboxLogEntry{Timestamp: time.Now().UTC(), Level: "warn",
				Message: "the sandbox's call log could not be read now; try again", Fields: map[string]string{"logger": "opendsec"}})
		} else if ok {
			for _, c := range calls {
				entries = append(entries, callEntries(c)...)
			}
		}
		slices.SortStableFunc(entries, func(a, b sandboxLogEntry) int { return a.Timestamp.Compare(b.Timestamp) })
		if search != "" {
			entries = slices.DeleteFunc(entries, func(e sandboxLogEntry) bool { return !strings.Contains(e.Message, search) })
		}
		out := filterLogs(entries, func(e sandboxLogEntry) (time.Time, string) { return e.Timestamp, e.Level },
			cursor, int(limit), dir == "backward", level)
		if v2 {
			writeJSON(w, http.StatusOK, map[string]any{"logs": out})
			return
		}
		lines := make([]map[string]any, 0, len(out))
		for _, e := range out {
			lines = append(lines, map[string]any{"timestamp": e.Timestamp, "line": e.line()})
		}
		writeJSON(w, http.StatusOK, map[string]any{"logs": lines, "logEntries": out})
	}
}

// line is the entry as E2B's v1 log line: a JSON object of its fields
// with level and message (the e2b CLI's `sandbox logs` parses it).
func (e sandboxLogEntry) line() string {
	m := make(map[string]string, len(e.Fields)+2)
	maps.Copy(m, e.Fields)
	m["level"], m["message"] = e.Level, e.Message
	b, _ := json.Marshal(m)
	return string(b)
}

// startEntry is the log entry of the sandbox's start.
func startEntry(sb *v1.Sandbox) sandboxLogEntry {
	l := sb.GetSpec().GetLabels()
	tpl := cmp.Or(l[labelTemplate], sb.GetSpec().GetImage(), sb.GetSpec().GetSnapshot())
	f := map[string]string{"logger": "opendsec", "event": "start", "sandboxID": sb.GetId(), "templateID": tpl}
	msg := "sandbox started from template " + tpl
	if p := sb.GetParentId(); p != "" {
		f["parentID"] = p
		msg += " (a fork of " + p + ")"
	}
	return sandboxLogEntry{Timestamp: sb.GetCreatedAt().AsTime().UTC(), Level: "info", Message: msg, Fields: f}
}

// callEntries are the log entries of one trajectory call: its start and,
// once it ended, its end.
func callEntries(c *v1.TrajectoryEntry) []sandboxLogEntry {
	f := map[string]string{"logger": "opendsec", "callID": c.GetCallId(), "kind": c.GetKind()}
	for k, v := range map[string]string{"user": c.GetUser(), "cwd": c.GetCwd(), "origin": c.GetOrigin(), "path": c.GetPath()} {
		if v != "" {
			f[k] = v
		}
	}
	if c.GetPid() != 0 {
		f["pid"] = strconv.FormatUint(uint64(c.GetPid()), 10)
	}
	what := ""
	switch c.GetKind() {
	case trajectory.KindExec:
		what = "process " + shownCommand(c.GetCommand())
	case trajectory.KindCode:
		what = "code execution"
	case trajectory.KindFileWrite:
		what = "file write " + c.GetPath()
	default:
		what = c.GetKind() + " call"
	}
	started := c.GetStarted().AsTime().UTC()
	out := []sandboxLogEntry{{Timestamp: started, Level: "info", Message: what + " started", Fields: f}}
	end := maps.Clone(f)
	ended := started
	if c.GetEnded() != nil {
		ended = c.GetEnded().AsTime().UTC()
	}
	switch c.GetState() {
	case trajectory.StateRunning:
		return out
	case trajectory.StateInterrupted:
		out = append(out, sandboxLogEntry{Timestamp: ended, Level: "warn", Message: what + " interrupted: the node lost its result", Fields: end})
		return out
	}
	if c.GetErrorCode() != "" || c.GetError() != "" {
		end["error"] = cmp.Or(c.GetErrorCode(), "unknown")
		msg := c.GetError()
		if msg == "" {
			msg = c.GetErrorCode()
		}
		out = append(out, sandboxLogEntry{Timestamp: ended, Level: "error", Message: what + " failed: " + msg, Fields: end})
		return out
	}
	if c.GetKind() == trajectory.KindFileWrite {
		end["size"] = strconv.FormatInt(c.GetSize(), 10)
		out = append(out, sandboxLogEntry{Timestamp: ended, Level: "info", Message: fmt.Sprintf("%s done (%d bytes)", what, c.GetSize()), Fields: end})
		return out
	}
	end["exitCode"] = strconv.Itoa(int(c.GetExitCode()))
	out = append(out, sandboxLogEntry{Timestamp: ended, Level: "info", Message: fmt.Sprintf("%s ended with exit code %d", what, c.GetExitCode()), Fields: end})
	return out
}

// shownCommand is a command for a log line: its words, with a long one cut.
func shownCommand(cmd []string) string {
	s := strings.Join(cmd, " ")
	if len(s) > maxLoggedCommand {
		s = s[:maxLoggedCommand] + "..."
	}
	return strconv.Quote(s)
}
