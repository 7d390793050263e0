package cli

import (
	"fmt"
	"io"
	"maps"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	opendsec "github.com/kernflux/opendsec/sdk/go"
)

// printJSON writes m as indented protojson with a trailing newline.
func printJSON(w io.Writer, m proto.Message) error {
	b, err := protojson.MarshalOptions{Multiline: true, Indent: "  "}.Marshal(m)
	if err != nil {
		return fmt.Errorf("encode json: %w", err)
	}
	_, err = fmt.Fprintf(w, "%s\n", b)
	return err
}

// stateName turns SANDBOX_STATE_RUNNING into "running".
func stateName(s opendsecv1.SandboxState) string {
	return strings.ToLower(strings.TrimPrefix(s.String(), "SANDBOX_STATE_"))
}

func fmtTime(ts *timestamppb.Timestamp) string {
	if ts == nil || (ts.Seconds == 0 && ts.Nanos == 0) {
		return "-"
	}
	return ts.AsTime().Local().Format(time.DateTime)
}

func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func fmtMap(m map[string]string) string {
	if len(m) == 0 {
		return "-"
	}
	var parts []string
	for _, k := range slices.Sorted(maps.Keys(m)) {
		parts = append(parts, k+"="+m[k])
	}
	return strings.Join(parts, ",")
}

// printSandboxTable writes one row per sandbox.
func printSandboxTable(w io.Writer, sbs []*opendsec.Sandbox) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tSTATE\tIMAGE\tBACKEND\tCPU\tMEMORY\tCREATED\tEXPIRES\tLABELS")
	for _, sb := range sbs {
		sp := sb.GetSpec()
		cpu := "-"
		if sp.GetCpu() > 0 {
			cpu = fmt.Sprintf("%g", sp.GetCpu())
		}
		mem := "-"
		if sp.GetMemoryMb() > 0 {
			mem = fmt.Sprintf("%dMiB", sp.GetMemoryMb())
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", sb.GetId(), stateName(sb.GetState()), orDash(sp.GetImage()),
			orDash(sp.GetBackend()), cpu, mem, fmtTime(sb.GetCreatedAt()), fmtTime(sb.GetExpiresAt()), fmtMap(sp.GetLabels()))
	}
	return tw.Flush()
}

// printSandboxDetail writes one sandbox as "key: value" lines.
func printSandboxDetail(w io.Writer, sb *opendsec.Sandbox) error {
	sp := sb.GetSpec()
	tw := tabwriter.NewWriter(w, 0, 4, 1, ' ', 0)
	rows := [][2]string{
		{"ID", sb.GetId()},
		{"Node", orDash(sb.GetNodeId())},
		{"Owner", orDash(sb.GetOwner())},
		{"Parent", orDash(sb.GetParentId())},
		{"State", stateName(sb.GetState())},
		{"Reason", orDash(sb.GetReason())},
		{"Image", orDash(sp.GetImage())},
		{"Backend", orDash(sp.GetBackend())},
		{"CPU", fmt.Sprintf("%g", sp.GetCpu())},
		{"Memory", fmt.Sprintf("%d MiB", sp.GetMemoryMb())},
		{"User", orDash(sp.GetUser())},
		{"Workdir", orDash(sp.GetWorkdir())},
		{"Task", orDash(sp.GetTaskId())},
		{"Env", fmtMap(sp.GetEnv())},
		{"Labels", fmtMap(sp.GetLabels())},
		{"Created", fmtTime(sb.GetCreatedAt())},
		{"Expires", fmtTime(sb.GetExpiresAt())},
		{"Last activity", fmtTime(sb.GetLastActivityAt())},
		{"From warm pool", yesNo(sb.GetFromWarmPool())},
	}
	if sp.GetIdleTimeoutSeconds() > 0 {
		rows = append(rows, [2]string{"Idle timeout", (time.Duration(sp.GetIdleTimeoutSeconds()) * time.Second).String()})
	}
	if sp.GetOnTimeout() == "pause" || sp.GetAutoPause() {
		rows = append(rows, [2]string{"On timeout", "pause"})
	}
	for _, r := range rows {
		fmt.Fprintf(tw, "%s:\t%s\n", r[0], r[1])
	}
	return tw.Flush()
}

func fileTypeName(t opendsecv1.FileType) string {
	switch t {
	case opendsecv1.FileType_FILE_TYPE_DIRECTORY:
		return "dir"
	case opendsecv1.FileType_FILE_TYPE_SYMLINK:
		return "symlink"
	case opendsecv1.FileType_FILE_TYPE_FILE:
		return "file"
	}
	return "-"
}

// printFileTable writes one row per file.
func printFileTable(w io.Writer, files []*opendsec.FileInfo) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "MODE\tOWNER\tSIZE\tMODIFIED\tTYPE\tNAME")
	for _, f := range files {
		name := f.GetName()
		if f.GetSymlinkTarget() != "" {
			name += " -> " + f.GetSymlinkTarget()
		}
		fmt.Fprintf(tw, "%#o\t%s\t%d\t%s\t%s\t%s\n", f.GetMode()&0o7777, orDash(f.GetOwner()), f.GetSize(), fmtTime(f.GetModifiedAt()), fileTypeName(f.GetType()), name)
	}
	return tw.Flush()
}
