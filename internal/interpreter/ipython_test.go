package interpreter

import (
	"bytes"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// transform runs interpreter.py --transform: the cells as the worker compiles them.
func transform(t *testing.T, cells []string) []string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "interpreter.py")
	if err := os.WriteFile(p, Source, 0o444); err != nil {
		t.Fatal(err)
	}
	in, _ := json.Marshal(cells)
	cmd := exec.Command("python3", p, "--transform")
	cmd.Stdin = bytes.NewReader(in)
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("transform: %v", err)
	}
	var got []string
	if err := json.Unmarshal(out, &got); err != nil || len(got) != len(cells) {
		t.Fatalf("transform output %s: %v", out, err)
	}
	return got
}

// The expected outputs are what IPython 8.12's TransformerManager.transform_cell
// gives for the same cells (checked side by side when this table was written).
func TestTransformCell(t *testing.T) {
	cases := []struct{ name, in, want string }{
		{"shell", "!echo hi", "get_ipython().system('echo hi')\n"},
		{"capture", "x = !ls -la", "x = get_ipython().getoutput('ls -la')\n"},
		{"capture tuple target", "a[0] = !pwd", "a[0] = get_ipython().getoutput('pwd')\n"},
		{"double bang", "!!ls", "get_ipython().getoutput('ls')\n"},
		{"line magic after a string with !", "print('!hi')\n%pip install a b",
			"print('!hi')\nget_ipython().run_line_magic('pip', 'install a b')\n"},
		{"indented in if", "if 1:\n    !echo $x {y+1}\n", "if 1:\n    get_ipython().system('echo $x {y+1}')\n"},
		{"indented in for", "for i in range(3):\n    !echo $i\n    y = !echo {i}\nprint(y)",
			"for i in range(3):\n    get_ipython().system('echo $i')\n    y = get_ipython().getoutput('echo {i}')\nprint(y)\n"},
		{"inside a triple-quoted string", "s = '''\n!not\n'''\n!yes", "s = '''\n!not\n'''\nget_ipython().system('yes')\n"},
		{"inside brackets", "f(a,\n!no)\n", "f(a,\n!no)\n"},
		{"after a backslash continuation", "x = 1 \\\n!no", "x = 1 \\\n!no\n"},
		{"continued shell line", "!echo a \\\n  b\n", "get_ipython().system('echo a    b')\n"},
		{"continued capture", "x = !echo a \\\n b", "x = get_ipython().getoutput('echo a   b')\n"},
		{"modulo and not-equal", "a = 5 % 3\nb != c\n", "a = 5 % 3\nb != c\n"},
		{"comparison is not capture", "x == !a", "x == !a\n"},
		{"magic capture", "x, y = %time f()", "x, y = get_ipython().run_line_magic('time', 'f()')\n"},
		{"string and comment with ! and %", "d = {'a': '!b'}  # !c", "d = {'a': '!b'}  # !c\n"},
		{"percent formatting", "s = \"it's %d\" % 3\n%env", "s = \"it's %d\" % 3\nget_ipython().run_line_magic('env', '')\n"},
		{"quote in a shell line", "!echo \"it's\"\n!echo ok", "get_ipython().system('echo \"it\\'s\"')\nget_ipython().system('echo ok')\n"},
		{"bash cell", "%%bash\necho hi\n", "get_ipython().run_cell_magic('bash', '', 'echo hi\\n')\n"},
		{"sh cell after blank lines, indented", "\n\n  %%sh -x\n  a\n", "get_ipython().run_cell_magic('sh', '-x', 'a\\n')\n"},
		{"writefile cell keeps ! lines", "%%writefile f.py\nprint('hi')\n!x\n",
			"get_ipython().run_cell_magic('writefile', 'f.py', \"print('hi')\\n!x\\n\")\n"},
		{"%% not first is a line magic", "x = 1\n%%bash\n", "x = 1\nget_ipython().run_line_magic('%bash', '')\n"},
		{"return ! stays python", "def f():\n    return !ls\n", "def f():\n    return !ls\n"},
	}
	var in []string
	for _, tc := range cases {
		in = append(in, tc.in)
	}
	for i, got := range transform(t, in) {
		if tc := cases[i]; got != tc.want {
			t.Errorf("%s: transform(%q)\n got %q\nwant %q", tc.name, tc.in, got, tc.want)
		}
	}
}

func TestShellLinesAndMagics(t *testing.T) {
	r := startRunner(t)
	x := r.exec(t, code("!echo hi\n!echo err >&2"))
	if x.stdout != "hi\n" || x.stderr != "err\n" || len(x.errs) != 0 {
		t.Fatalf("!echo: %+v", x)
	}
	x = r.exec(t, code("n = 3\nfor i in range(2):\n    !echo $i {n*2} $$ODS_NONE. '$n'\nfiles = !printf 'a\\nb\\n'\nfiles"))
	if x.stdout != "0 6 . $n\n1 6 . $n\n" || len(x.results) != 1 || x.results[0]["text"] != "['a', 'b']" {
		t.Fatalf("expansion and capture: %+v", x)
	}
	x = r.exec(t, code("files.s, files.n, files.grep('b')"))
	if len(x.results) != 1 || x.results[0]["text"] != `('a b', 'a\nb', ['b'])` {
		t.Fatalf("SList: %+v %+v", x.results, x.errs)
	}
	x = r.exec(t, code("!echo out; exit 3\n_exit_code"))
	if x.stdout != "out\n" || len(x.errs) != 0 || len(x.results) != 1 || x.results[0]["text"] != "3" {
		t.Fatalf("non-zero exit: %+v", x)
	}
	x = r.exec(t, code("%%bash\necho from bash\necho $BASH_VERSION | cut -c1 | grep -q . && echo is bash"))
	if x.stdout != "from bash\nis bash\n" || len(x.errs) != 0 {
		t.Fatalf("%%%%bash: %+v", x)
	}
	x = r.exec(t, code("%%sh\necho before\nexit 2"))
	if x.stdout != "before\n" || len(x.errs) != 1 || x.errs[0]["name"] != "CalledProcessError" {
		t.Fatalf("%%%%sh failing: %+v", x)
	}
	dir := t.TempDir()
	x = r.exec(t, code("%cd "+dir+"\nimport os\nos.getcwd()"))
	if x.stdout != dir+"\n" || len(x.results) != 1 || x.results[0]["text"] != "'"+dir+"'" {
		t.Fatalf("%%cd: %+v", x)
	}
	if x = r.exec(t, code("!pwd")); x.stdout != dir+"\n" {
		t.Fatalf("!pwd after %%cd: %+v", x)
	}
	x = r.exec(t, code("%env ODS_K=v1\n%env ODS_K"))
	if x.stdout != "env: ODS_K=v1\n" || len(x.results) != 1 || x.results[0]["text"] != "'v1'" {
		t.Fatalf("%%env: %+v", x)
	}
	if x = r.exec(t, code("!echo $ODS_K")); x.stdout != "v1\n" {
		t.Fatalf("%%env not seen by a shell line: %+v", x)
	}
	x = r.exec(t, code("%foo bar"))
	if len(x.errs) != 1 || x.errs[0]["name"] != "UsageError" || x.errs[0]["value"] != "Line magic function `%foo` not found." ||
		x.errs[0]["traceback"] != "UsageError: Line magic function `%foo` not found.\n" {
		t.Fatalf("unknown magic: %+v", x.errs)
	}
	x = r.exec(t, code("%%nope\nbody"))
	if len(x.errs) != 1 || x.errs[0]["name"] != "UsageError" || x.errs[0]["value"] != "Cell magic `%%nope` not found." {
		t.Fatalf("unknown cell magic: %+v", x.errs)
	}
	x = r.exec(t, code("%time sum(range(10))"))
	if !strings.Contains(x.stdout, "CPU times: user") || !strings.Contains(x.stdout, "Wall time: ") || len(x.results) != 1 || x.results[0]["text"] != "45" {
		t.Fatalf("%%time: %+v", x)
	}
	x = r.exec(t, code("%%writefile w.txt\nline !x\n"))
	if b, err := os.ReadFile(filepath.Join(dir, "w.txt")); err != nil || string(b) != "line !x\n" || x.stdout != "Writing w.txt\n" {
		t.Fatalf("%%%%writefile: %q %v %+v", b, err, x)
	}
	// pip is the interpreter's own python's, its output streamed; with no
	// index to reach it fails with its own message.
	for _, c := range []string{"%pip install --no-index nosuchpkg-xyz", "!pip install --no-index nosuchpkg-xyz"} {
		x = r.exec(t, code(c))
		if len(x.errs) != 0 || strings.Contains(x.stdout+x.stderr, "SyntaxError") {
			t.Fatalf("%s: %+v", c, x)
		}
		if out := x.stdout + x.stderr; !strings.Contains(out, "No matching distribution found for nosuchpkg-xyz") && !strings.Contains(out, "No module named pip") {
			t.Fatalf("%s: no pip message in %q", c, out)
		}
	}
}
