package vmm

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kernflux/opendsec/internal/errdefs"
)

// TestSumFile: the size always, the sha256 only when asked; a missing
// file is fs.ErrNotExist.
func TestSumFile(t *testing.T) {
	p := filepath.Join(t.TempDir(), "f")
	if err := os.WriteFile(p, []byte("abc"), 0o600); err != nil {
		t.Fatal(err)
	}
	s, err := SumFile(p, false)
	if err != nil || s != (FileSum{Size: 3}) {
		t.Fatalf("SumFile without digest: %+v, %v; want size 3, no digest", s, err)
	}
	s, err = SumFile(p, true)
	const abc = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
	if err != nil || s != (FileSum{Size: 3, SHA256: abc}) {
		t.Fatalf("SumFile with digest: %+v, %v; want size 3, sha256 %s", s, err, abc)
	}
	if n, h, err := HashReader(strings.NewReader("abc")); err != nil || n != 3 || h != abc {
		t.Fatalf("HashReader: %d %s %v", n, h, err)
	}
	if _, err := SumFile(filepath.Join(t.TempDir(), "none"), true); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("SumFile of a missing file: %v; want not exist", err)
	}
}

type runState struct {
	ID  string `json:"id"`
	Pid int    `json:"pid,omitempty"`
}

// TestRunFile: a written run file reads back, a rewrite replaces it and
// leaves no temporary file; a missing one is fs.ErrNotExist, a corrupted
// one ErrInternal, and a write that fails leaves the old file as it was.
func TestRunFile(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "vm.json")
	var got runState
	if err := ReadRunFile(p, &got); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("read of no run file: %v; want not exist", err)
	}
	if err := WriteRunFile(p, runState{ID: "a"}); err != nil {
		t.Fatal(err)
	}
	if err := WriteRunFile(p, runState{ID: "a", Pid: 42}); err != nil {
		t.Fatal(err)
	}
	if err := ReadRunFile(p, &got); err != nil || got != (runState{ID: "a", Pid: 42}) {
		t.Fatalf("read back: %+v, %v; want the second write", got, err)
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 1 {
		t.Fatalf("dir holds %d entries after two writes; want the run file only", len(ents))
	}
	// A write that cannot make its temporary file changes nothing.
	if err := os.Mkdir(p+".tmp", 0o700); err != nil {
		t.Fatal(err)
	}
	if err := WriteRunFile(p, runState{ID: "b"}); err == nil {
		t.Fatal("write with its temporary path taken by a directory: no error")
	}
	if err := ReadRunFile(p, &got); err != nil || got.ID != "a" {
		t.Fatalf("after a failed write: %+v, %v; want the old file", got, err)
	}
	if err := os.WriteFile(p, []byte("{"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := ReadRunFile(p, &got); !errors.Is(err, errdefs.ErrInternal) || !strings.Contains(err.Error(), p) {
		t.Fatalf("read of a corrupted run file: %v; want internal, naming the file", err)
	}
}

// TestLastLines: the last n lines of a log, trailing blank lines aside.
func TestLastLines(t *testing.T) {
	for _, tc := range []struct {
		in   string
		n    int
		want string
	}{
		{"a\nb\nc\n\n", 2, "b | c"},
		{"a\nb", 5, "a | b"},
		{"", 3, ""},
	} {
		if got := LastLines([]byte(tc.in), tc.n); got != tc.want {
			t.Errorf("LastLines(%q, %d) = %q; want %q", tc.in, tc.n, got, tc.want)
		}
	}
}
