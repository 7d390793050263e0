"""OpenDsec code interpreter: what E2B's code-interpreter SDKs call on port 49999.

Stdlib only. The server (default mode) serves HTTP on 127.0.0.1:49999:

  POST /execute              {"code", "context_id"?, "language"?, "env_vars"?}
                             -> newline-delimited JSON events, then EOF
  POST /contexts             {"language"?, "cwd"?} -> {"id", "language", "cwd"}
  GET  /contexts             -> [{"id", "language", "cwd"}]
  POST /contexts/{id}/restart, DELETE /contexts/{id}
  GET  /health               -> "OK"

Each context is a persistent Python process (this file run with --worker):
variables survive between executions, and the value of the last expression
becomes the main result, as in Jupyter.
"""

import ast
import base64
import codecs
import datetime
import io
import json
import linecache
import os
import re
import shlex
import queue
import subprocess
import sys
import threading
import time
import traceback
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

KEEPALIVE_SECONDS = 5
DEFAULT_CWD = "/home/user"
PYTHON_NAMES = ("python", "python3", "")


def now():
    return datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z")


# ---------------------------------------------------------------- worker side


class _Emitter:
    """Writes one JSON event per line to the server."""

    def __init__(self, f):
        self.f = f
        self.lock = threading.Lock()

    def send(self, ev):
        line = json.dumps(ev, default=str) + "\n"
        with self.lock:
            self.f.write(line.encode("utf-8", "replace"))
            self.f.flush()


class _Stream(io.TextIOBase):
    """sys.stdout / sys.stderr of executed code: emits whole lines as events."""

    def __init__(self, emitter, kind):
        self.emitter = emitter
        self.kind = kind
        self.buf = []

    @property
    def encoding(self):
        return "utf-8"

    def writable(self):
        return True

    def isatty(self):
        return False

    def write(self, s):
        if not isinstance(s, str):
            raise TypeError("write() argument must be str, not %s" % type(s).__name__)
        if not s:
            return 0
        self.buf.append(s)
        if "\n" in s or sum(len(b) for b in self.buf) > 8192:
            self.flush()
        return len(s)

    def flush(self):
        if self.buf:
            text = "".join(self.buf)
            self.buf = []
            self.emitter.send({"type": self.kind, "text": text, "timestamp": now()})


_MIME_METHODS = (
    ("text/html", "_repr_html_", "html"),
    ("text/markdown", "_repr_markdown_", "markdown"),
    ("image/svg+xml", "_repr_svg_", "svg"),
    ("image/png", "_repr_png_", "png"),
    ("image/jpeg", "_repr_jpeg_", "jpeg"),
    ("application/pdf", "_repr_pdf_", "pdf"),
    ("text/latex", "_repr_latex_", "latex"),
    ("application/json", "_repr_json_", "json"),
    ("application/javascript", "_repr_javascript_", "javascript"),
)
_MIME_KEYS = {mime: key for mime, _, key in _MIME_METHODS}
_MIME_KEYS["text/plain"] = "text"


def _encode(key, v):
    if isinstance(v, tuple) and len(v) == 2:  # (data, metadata)
        v = v[0]
    if isinstance(v, (bytes, bytearray)):
        if key in ("png", "jpeg", "pdf"):
            return base64.b64encode(bytes(v)).decode("ascii")
        return bytes(v).decode("utf-8", "replace")
    return v


def format_result(value, is_main):
    """A result event for value: text/plain plus the rich forms it offers."""
    ev = {"type": "result", "is_main_result": is_main}
    bundle = getattr(value, "_repr_mimebundle_", None)
    if callable(bundle) and not isinstance(value, type):
        try:
            data = bundle()
            if isinstance(data, tuple):
                data = data[0]
            for mime, v in (data or {}).items():
                key = _MIME_KEYS.get(mime)
                if key and v is not None:
                    ev[key] = _encode(key, v)
        except Exception:
            pass
    for mime, meth, key in _MIME_METHODS:
        if key in ev:
            continue
        f = getattr(value, meth, None)
        if not callable(f) or isinstance(value, type):
            continue
        try:
            v = f()
        except Exception:
            continue
        if v is not None:
            ev[key] = _encode(key, v)
    if "text" not in ev:
        try:
            ev["text"] = repr(value)
        except Exception as e:  # a broken __repr__ must not end the execution
            ev["text"] = "<repr failed: %s: %s>" % (type(e).__name__, e)
    return ev


# ---------------------------------------------------------------- IPython syntax
#
# E2B's interpreter is Jupyter, so cells carry IPython's escapes. transform_cell
# rewrites them into calls on get_ipython() the way IPython's inputtransformer2
# does, without needing IPython: a cell starting with %%name is a cell magic;
# at the start of a logical line (after indentation; not inside a string,
# brackets or a backslash continuation) !cmd, !!cmd and %magic become
# system / getoutput / run_line_magic; `lhs = !cmd` and `lhs = %magic` capture.
# A trailing backslash continues an escaped line onto the next one.


def _leading_indent(lines):
    m = re.match(r"^[ \t]+", lines[0]) if lines else None
    if not m:
        return lines
    space = m.group(0)
    return [l[len(space):] if l.startswith(space) else l for l in lines]


def _end_of_continued(lines, start):
    end = start
    while lines[end].endswith("\\\n"):
        end += 1
        if end >= len(lines):
            end = len(lines) - 1
            break
    return end


def _assemble_continued(lines, start, col, end):
    parts = [lines[start][col:]] + lines[start + 1:end + 1]
    return " ".join([p.rstrip()[:-1] for p in parts[:-1]] + [parts[-1].rstrip()])


class _Scan:
    """Where a physical line starts: inside a string, brackets or a
    continuation, or at the start of a logical line."""

    def __init__(self):
        self.quote = None  # the open string's delimiter
        self.depth = 0
        self.continued = False

    def at_start(self):
        return self.quote is None and self.depth == 0 and not self.continued

    def feed(self, line):
        self.continued = False
        i, n = 0, len(line)
        while i < n:
            c = line[i]
            if self.quote is not None:
                if c == "\\":
                    i += 2
                    continue
                if line.startswith(self.quote, i):
                    i += len(self.quote)
                    self.quote = None
                    continue
                if c == "\n" and len(self.quote) == 1:
                    self.quote = None  # unterminated: the tokenizer gives up too
                i += 1
                continue
            if c == "#":
                break
            if c in "'\"":
                self.quote = c * 3 if line.startswith(c * 3, i) else c
                i += len(self.quote)
                continue
            if c in "([{":
                self.depth += 1
            elif c in ")]}":
                self.depth = max(0, self.depth - 1)
            elif c == "\\" and line[i + 1:i + 2] == "\n":
                self.continued = True
            i += 1
        if self.quote is not None and len(self.quote) == 1 and not line.endswith("\\\n"):
            self.quote = None


_ASSIGN_PREV = set("=!<>+-*/%&|^@:~")


def _assign_escape(line):
    """The column of the ! or % right after a top-level `=` of line, else None."""
    i, n, depth = 0, len(line), 0
    while i < n:
        c = line[i]
        if c == "#":
            return None
        if c in "'\"":
            q = c * 3 if line.startswith(c * 3, i) else c
            j = i + len(q)
            while j < n and not line.startswith(q, j):
                j += 2 if line[j] == "\\" else 1
            if j >= n:
                return None
            i = j + len(q)
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth = max(0, depth - 1)
        elif c == "=" and depth == 0:
            if (i > 0 and line[i - 1] in _ASSIGN_PREV) or line[i + 1:i + 2] == "=":
                return None  # ==, <=, +=, ... : not an assignment
            if not line[:i].strip():
                return None
            j = i + 1
            while j < n and line[j] in " \t":
                j += 1
            if line[j:j + 1] == "!" and line[j + 1:j + 2] != "=":
                return j
            if line[j:j + 1] == "%" and re.match(r"\w", line[j + 1:j + 2]):
                return j
            return None
        i += 1
    return None


def _escaped_call(text):
    if text.startswith("!!"):
        return "get_ipython().getoutput(%r)" % text[2:]
    if text.startswith("!"):
        return "get_ipython().system(%r)" % text[1:]
    name, _, args = text[1:].partition(" ")
    return "get_ipython().run_line_magic(%r, %r)" % (name, args)


def transform_cell(cell):
    """cell with IPython's escapes rewritten into plain Python."""
    if not cell.endswith("\n"):
        cell += "\n"
    lines = cell.splitlines(True)
    while lines and not lines[0].strip():
        lines.pop(0)
    lines = _leading_indent(lines)
    if lines and lines[0].startswith("%%") and not re.match(r"%%\w+\?", lines[0]):
        name, _, first = lines[0][2:].rstrip().partition(" ")
        return "get_ipython().run_cell_magic(%r, %r, %r)\n" % (name, first, "".join(lines[1:]))
    out, scan, i = [], _Scan(), 0
    while i < len(lines):
        line = lines[i]
        if scan.at_start():
            body = line.lstrip(" \t")
            col = len(line) - len(body)
            if body[:1] in ("!", "%") and body[1:2] != "=":
                end = _end_of_continued(lines, i)
                text = _assemble_continued(lines, i, col, end)
                out.append(line[:col] + _escaped_call(text) + "\n")
                i = end + 1
                continue
            col = _assign_escape(line)
            if col is not None:
                end = _end_of_continued(lines, i)
                rhs = _assemble_continued(lines, i, col, end)
                if rhs[0] == "!":
                    call = "get_ipython().getoutput(%r)" % rhs[1:]
                else:
                    name, _, args = rhs[1:].partition(" ")
                    call = "get_ipython().run_line_magic(%r, %r)" % (name, args)
                out.append(line[:col] + call + "\n")
                i = end + 1
                continue
        scan.feed(line)
        out.append(line)
        i += 1
    return "".join(out)


class UsageError(Exception):
    """IPython's error for a magic used wrongly or not known."""


class SList(list):
    """IPython's list of output lines (x = !cmd): .s, .n, .l, .p, grep, fields."""

    def get_list(self):
        return self

    l = list = property(get_list)

    @property
    def s(self):
        return " ".join(self)

    spstr = s

    @property
    def n(self):
        return "\n".join(self)

    nlstr = n

    @property
    def p(self):
        return [p for p in self if os.path.exists(p)]

    paths = p

    def grep(self, pattern, prune=False, field=None):
        match = pattern if callable(pattern) else (lambda s: re.search(pattern, s, re.IGNORECASE))
        def pick(s):
            if field is None:
                return s
            parts = s.split()
            return parts[field] if -len(parts) <= field < len(parts) else ""
        return SList([s for s in self if bool(match(pick(s))) != prune])

    def fields(self, *fields):
        if not fields:
            return SList([l.split() for l in self])
        res = SList()
        for parts in (l.split() for l in self):
            got = [parts[f] for f in fields if -len(parts) <= f < len(parts)]
            if got:
                res.append(" ".join(got))
        return res


_DOLLAR = re.compile(r"\$(\$|[A-Za-z_][\w.]*)")


def _format_time(t):
    for unit, scale in (("s", 1.0), ("ms", 1e3), ("µs", 1e6), ("ns", 1e9)):
        if t >= 1.0 / scale * 0.999 or unit == "ns":
            return "%.3g %s" % (t * scale, unit)
    return "%.3g s" % t


class Shell:
    """What get_ipython() returns in a cell: the part of IPython's
    InteractiveShell that transformed cells call."""

    def __init__(self, worker):
        self.worker = worker
        self.user_ns = worker.ns
        self.oldpwd = None

    # $name and {expr} in shell lines and magic arguments, evaluated in the
    # caller's locals and the user namespace; on any failure the text stays.
    def var_expand(self, cmd, depth=0):
        frame = sys._getframe(depth + 1)
        ns = dict(self.user_ns)
        if frame.f_locals is not self.user_ns:
            ns.update(frame.f_locals)
        try:
            return self._expand(cmd, ns)
        except Exception:
            return cmd

    @staticmethod
    def _expand(cmd, ns):
        out, i, n = [], 0, len(cmd)
        in_single = False
        while i < n:
            c = cmd[i]
            if c == "'":
                in_single = not in_single
            if c == "{":
                if cmd.startswith("{{", i):
                    out.append("{")
                    i += 2
                    continue
                j = cmd.index("}", i)
                out.append(str(eval(cmd[i + 1:j], ns)))
                i = j + 1
                continue
            if c == "}" and cmd.startswith("}}", i):
                out.append("}")
                i += 2
                continue
            if c == "$" and not in_single:
                m = _DOLLAR.match(cmd, i)
                if m:
                    if m.group(1) == "$":
                        out.append("$")
                    else:
                        out.append(str(eval(m.group(1), ns)))
                    i = m.end()
                    continue
            out.append(c)
            i += 1
        return "".join(out)

    @staticmethod
    def _pip(cmd):
        m = re.match(r"\s*pip3?(\s|$)", cmd)
        if m:
            return shlex.quote(sys.executable) + " -m pip" + cmd[m.end(0) - len(m.group(1)):]
        return cmd

    def _run(self, argv_or_cmd, capture=False, shell=True):
        """Runs a shell command, streaming its stdout/stderr as the cell's
        (or collecting both when capture); returns (exit code, output)."""
        for s in (sys.stdout, sys.stderr):
            s.flush()
        p = subprocess.Popen(argv_or_cmd, shell=shell, executable="/bin/sh" if shell else None,
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT if capture else subprocess.PIPE)
        got = []

        def pump(f, dest):
            dec = codecs.getincrementaldecoder("utf-8")("replace")
            while True:
                b = f.read1(65536) if hasattr(f, "read1") else f.read(65536)
                if not b:
                    break
                s = dec.decode(b)
                if capture:
                    got.append(s)
                else:
                    dest.write(s)
            s = dec.decode(b"", True)
            if s and not capture:
                dest.write(s)
            elif s:
                got.append(s)
            if not capture:
                dest.flush()

        threads = [threading.Thread(target=pump, args=(p.stdout, sys.stdout), daemon=True)]
        if not capture:
            threads.append(threading.Thread(target=pump, args=(p.stderr, sys.stderr), daemon=True))
        for t in threads:
            t.start()
        try:
            rc = p.wait()
        except KeyboardInterrupt:
            p.kill()
            rc = p.wait()
        for t in threads:
            t.join()
        return rc, "".join(got)

    def system(self, cmd):
        """!cmd: runs cmd with /bin/sh, output streamed; sets _exit_code."""
        cmd = self._pip(self.var_expand(cmd, depth=1))
        rc, _ = self._run(cmd)
        self.user_ns["_exit_code"] = rc  # -N for a signal, as IPython

    system_piped = system_raw = system

    def getoutput(self, cmd, split=True, depth=0):
        """x = !cmd and !!cmd: stdout and stderr of cmd as an SList of lines."""
        cmd = self._pip(self.var_expand(cmd, depth=depth + 1))
        rc, out = self._run(cmd, capture=True)
        self.user_ns["_exit_code"] = rc
        return SList(out.splitlines()) if split else out

    def run_line_magic(self, magic_name, line, _stack_depth=1):
        f = getattr(self, "_magic_" + magic_name, None)
        if f is None:
            if magic_name in _ALIASES:
                return self.system(" ".join(x for x in (magic_name, line) if x))
            raise UsageError("Line magic function `%%%s` not found." % magic_name)
        if magic_name not in ("time", "timeit"):
            line = self.var_expand(line, _stack_depth)
        return f(line)

    def run_cell_magic(self, magic_name, line, cell):
        f = getattr(self, "_cell_" + magic_name, None)
        if f is None:
            raise UsageError("Cell magic `%%%%%s` not found." % magic_name)
        return f(self.var_expand(line, 1), cell)

    # ---- line magics

    def _magic_pip(self, line):
        self.system(" ".join([shlex.quote(sys.executable), "-m", "pip", line]))
        if line.split()[:1] and line.split()[0] in ("install", "uninstall"):
            print("Note: you may need to restart the kernel to use updated packages.")

    def _magic_cd(self, line):
        args = line.split()
        quiet = "-q" in args
        args = [a for a in args if a != "-q"]
        target = " ".join(args).strip("'\"") if args else os.path.expanduser("~")
        if target == "-":
            if self.oldpwd is None:
                raise UsageError("%cd -: no previous directory to change to")
            target = self.oldpwd
        try:
            old = os.getcwd()
            os.chdir(os.path.expanduser(target))
            self.oldpwd = old
        except OSError as e:
            print(e)
            return
        if not quiet:
            print(os.getcwd())

    def _magic_pwd(self, line):
        return os.getcwd()

    def _magic_env(self, line):
        line = line.strip()
        if not line:
            return dict(os.environ)
        if "=" in line:
            key, val = line.split("=", 1)
        elif " " in line:
            key, val = line.split(" ", 1)
        else:
            try:
                return os.environ[line]
            except KeyError:
                raise UsageError("Environment does not have key: %s" % line) from None
        key, val = key.strip(), val.strip()
        os.environ[key] = val
        self.worker.env_set.add(key)
        print("env: %s=%s" % (key, val))

    def _magic_set_env(self, line):
        return self._magic_env(line)

    def _magic_sx(self, line):
        return self.getoutput(line, depth=1)

    _magic_system = _magic_sx

    def _magic_matplotlib(self, line):
        # Figures are shown as results by plt.show() in E2B; here the
        # non-interactive backend keeps matplotlib from looking for a display.
        os.environ.setdefault("MPLBACKEND", "Agg")

    def _magic_time(self, line, cell=None):
        src = transform_cell(cell) if cell is not None else line
        name = "<timed exec>"
        try:
            tree = ast.parse(src, name, "exec")
        except SyntaxError:
            raise
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        t0, c0 = time.perf_counter(), time.process_time()
        r0 = os.times()
        value = None
        try:
            exec(compile(tree, name, "exec"), self.user_ns)
            if last is not None:
                value = eval(compile(last, name, "eval"), self.user_ns)
        finally:
            r1 = os.times()
            wall = time.perf_counter() - t0
            user, sys_ = r1.user - r0.user, r1.system - r0.system
            print("CPU times: user %s, sys: %s, total: %s" % (_format_time(user), _format_time(sys_), _format_time(user + sys_)))
            print("Wall time: %s" % _format_time(wall))
        return value

    def _magic_timeit(self, line, cell=None):
        import timeit
        setup, stmt = (line, cell) if cell is not None else ("pass", line)
        t = timeit.Timer(stmt, setup, globals=self.user_ns)
        number, _ = t.autorange()
        runs = [x / number for x in t.repeat(7, number)]
        mean = sum(runs) / len(runs)
        std = (sum((x - mean) ** 2 for x in runs) / len(runs)) ** 0.5
        print("%s ± %s per loop (mean ± std. dev. of 7 runs, %d loop%s each)" % (
            _format_time(mean), _format_time(std), number, "" if number == 1 else "s"))

    # ---- cell magics

    def _script(self, argv, cell):
        p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        p.stdin.write(cell.encode("utf-8"))
        p.stdin.close()
        rc = self._run_started(p)
        if rc != 0:
            raise subprocess.CalledProcessError(rc, cell)

    @staticmethod
    def _run_started(p):
        def pump(f, dest):
            dec = codecs.getincrementaldecoder("utf-8")("replace")
            while True:
                b = f.read1(65536)
                if not b:
                    break
                dest.write(dec.decode(b))
            dest.write(dec.decode(b"", True))
            dest.flush()
        ts = [threading.Thread(target=pump, args=(p.stdout, sys.stdout), daemon=True),
              threading.Thread(target=pump, args=(p.stderr, sys.stderr), daemon=True)]
        for t in ts:
            t.start()
        rc = p.wait()
        for t in ts:
            t.join()
        return rc

    def _cell_bash(self, line, cell):
        self._script(["bash"] + shlex.split(line), cell)

    def _cell_sh(self, line, cell):
        self._script(["/bin/sh"] + shlex.split(line), cell)

    def _cell_script(self, line, cell):
        argv = shlex.split(line)
        if not argv:
            raise UsageError("%%script: give the program to run the cell, e.g. %%script bash")
        self._script(argv, cell)

    def _cell_writefile(self, line, cell):
        args = shlex.split(line)
        append = "-a" in args or "--append" in args
        args = [a for a in args if a not in ("-a", "--append")]
        if len(args) != 1:
            raise UsageError("%%writefile: give one file name, e.g. %%writefile hello.py")
        path = os.path.expanduser(args[0])
        exists = os.path.exists(path)
        if exists:
            print(("Appending to %s" if append else "Overwriting %s") % args[0])
        else:
            print("Writing %s" % args[0])
        with open(path, "a" if append else "w") as f:
            f.write(cell)

    def _cell_time(self, line, cell):
        return self._magic_time(line, cell)

    def _cell_timeit(self, line, cell):
        return self._magic_timeit(line, cell)


# IPython's default shell aliases on Linux: %ls and friends run the command.
_ALIASES = ("cat", "cp", "ls", "mkdir", "mv", "rm", "rmdir")


class Worker:
    def __init__(self, emitter):
        self.emitter = emitter
        self.count = 0
        self.ns = {"__name__": "__main__", "__builtins__": __builtins__}
        self.ns["display"] = self.display
        self.shell = Shell(self)
        self.ns["get_ipython"] = lambda: self.shell
        self.env_set = set()  # keys %env set: they outlive the execution's env_vars
        self.stdout = _Stream(emitter, "stdout")
        self.stderr = _Stream(emitter, "stderr")

    def display(self, *objs, **_):
        for o in objs:
            self.stdout.flush()
            self.emitter.send(format_result(o, False))

    def _flush(self):
        self.stdout.flush()
        self.stderr.flush()

    def error(self, exc, skip_frames):
        self._flush()
        tb = exc.__traceback__
        for _ in range(skip_frames):
            if tb is not None:
                tb = tb.tb_next
        if isinstance(exc, (SyntaxError, UsageError)):
            lines = traceback.format_exception_only(type(exc), exc)
        else:
            lines = traceback.format_exception(type(exc), exc, tb)
        self.emitter.send({"type": "error", "name": type(exc).__name__, "value": str(exc), "traceback": "".join(lines)})

    def execute(self, code, env_vars):
        self.count += 1
        self.emitter.send({"type": "number_of_executions", "execution_count": self.count})
        saved = {}
        self.env_set = set()
        for k, v in (env_vars or {}).items():
            saved[k] = os.environ.get(k)
            os.environ[k] = str(v)
        old = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = self.stdout, self.stderr
        try:
            self._run(code)
        finally:
            self._flush()
            sys.stdout, sys.stderr = old
            for k, v in saved.items():
                if k in self.env_set:
                    continue
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def _run(self, code):
        name = "<cell %d>" % self.count
        code = transform_cell(code)
        linecache.cache[name] = (len(code), None, code.splitlines(True), name)
        try:
            tree = ast.parse(code, name, "exec")
        except SyntaxError as e:
            self.error(e, 0)
            return
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        try:
            exec(compile(tree, name, "exec"), self.ns)
            if last is not None:
                value = eval(compile(last, name, "eval"), self.ns)
                if value is not None:
                    self.ns["_"] = value
                    self._flush()
                    self.emitter.send(format_result(value, True))
        except SystemExit as e:
            self.error(e, 1)
        except KeyboardInterrupt as e:
            self.error(e, 1)
        except BaseException as e:
            self.error(e, 1)


def worker_main():
    # fd 0/1 carry the protocol; executed code gets an empty stdin and its
    # fd 1 goes to fd 2 (the server's log), so it cannot corrupt the stream.
    cmd_in = os.fdopen(os.dup(0), "rb")
    ev_out = os.fdopen(os.dup(1), "wb")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)
    sys.stdin = io.StringIO("")
    w = Worker(_Emitter(ev_out))
    w.emitter.send({"type": "ready"})
    for line in cmd_in:
        try:
            req = json.loads(line)
        except ValueError:
            continue
        try:
            w.execute(req.get("code", ""), req.get("env_vars"))
        except BaseException as e:  # keep the context alive whatever happens
            try:
                w.error(e, 0)
            except Exception:
                pass
        w.emitter.send({"type": "end_of_execution"})


# ---------------------------------------------------------------- server side


class ContextGone(Exception):
    pass


class Context:
    def __init__(self, cid, language, cwd):
        self.id = cid
        self.language = language
        self.cwd = cwd
        self.lock = threading.Lock()  # one execution at a time
        self.proc = None
        self.events = None
        self.start()

    def info(self):
        return {"id": self.id, "language": self.language, "cwd": self.cwd}

    def start(self):
        self.events = queue.Queue()
        self.proc = subprocess.Popen(
            [sys.executable, "-u", os.path.abspath(__file__), "--worker"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=self.cwd,
            close_fds=True,
        )
        threading.Thread(target=self._read, args=(self.proc, self.events), daemon=True).start()
        ev = self.events.get()
        if ev is None or ev.get("type") != "ready":
            raise ContextGone("the python process of context %s did not start" % self.id)

    @staticmethod
    def _read(proc, events):
        for line in proc.stdout:
            try:
                events.put(json.loads(line))
            except ValueError:
                pass
        events.put(None)

    def stop(self):
        p = self.proc
        if p is not None and p.poll() is None:
            p.kill()
            p.wait()

    def restart(self):
        self.stop()
        with self.lock:
            self.start()

    def execute(self, code, env_vars, emit):
        """Runs code, calling emit(event) for each event; emit returns False
        once the client is gone (events are still drained)."""
        with self.lock:
            if self.proc.poll() is not None:
                self.start()
            events = self.events
            req = json.dumps({"code": code, "env_vars": env_vars}) + "\n"
            try:
                self.proc.stdin.write(req.encode("utf-8"))
                self.proc.stdin.flush()
            except OSError:
                emit({"type": "error", "name": "ContextRestarting", "value": "the context's python process ended", "traceback": ""})
                return
            alive = True
            while True:
                try:
                    ev = events.get(timeout=KEEPALIVE_SECONDS)
                except queue.Empty:
                    if alive:
                        alive = emit({"type": "keepalive"})
                    continue
                if ev is None:
                    if alive:
                        emit({"type": "error", "name": "UnexpectedEndOfExecution",
                              "value": "the python process of the context ended during the execution", "traceback": ""})
                    return
                if ev.get("type") == "end_of_execution":
                    return
                if alive:
                    alive = emit(ev)


class Contexts:
    def __init__(self):
        self.lock = threading.Lock()
        self.by_id = {}
        self.default = None

    def get_default(self):
        with self.lock:
            if self.default is None:
                self.default = Context("default", "python", default_cwd())
            return self.default

    def create(self, language, cwd):
        ctx = Context(uuid.uuid4().hex, language, cwd)
        with self.lock:
            self.by_id[ctx.id] = ctx
        return ctx

    def get(self, cid):
        with self.lock:
            if cid == "default":
                return self.default
            return self.by_id.get(cid)

    def remove(self, cid):
        with self.lock:
            ctx = self.by_id.pop(cid, None)
        if ctx is not None:
            ctx.stop()
        return ctx

    def list(self):
        with self.lock:
            return [c.info() for c in self.by_id.values()]


def default_cwd():
    for d in (DEFAULT_CWD, os.path.expanduser("~")):
        if os.path.isdir(d):
            return d
    return "/"


def normalize_language(lang):
    if lang is None or lang in PYTHON_NAMES:
        return "python"
    return {"js": "javascript", "ts": "typescript"}.get(lang, lang)


class BadRequest(Exception):
    pass


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "opendsec-interpreter/1"
    contexts = None  # set by serve()

    def log_message(self, fmt, *args):
        pass

    def _body(self):
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n > 0 else b""
        if not raw.strip():
            return {}
        try:
            body = json.loads(raw)
        except ValueError as e:
            raise BadRequest("body: not valid JSON (%s); send a JSON object" % e)
        if not isinstance(body, dict):
            raise BadRequest("body: must be a JSON object")
        return body

    def _send(self, status, body, ctype="application/json"):
        if not isinstance(body, bytes):
            body = (json.dumps(body) if ctype == "application/json" else str(body)).encode()
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _text(self, status, msg):
        self._send(status, msg, "text/plain; charset=utf-8")

    def _route(self, method):
        path = self.path.split("?", 1)[0].rstrip("/") or "/"
        try:
            if method == "GET" and path == "/health":
                return self._send(200, "OK")
            if method == "POST" and path == "/execute":
                return self._execute()
            if path == "/contexts":
                if method == "POST":
                    return self._create()
                if method == "GET":
                    return self._send(200, self.contexts.list())
            parts = path.split("/")
            if len(parts) == 3 and parts[1] == "contexts" and method == "DELETE":
                if self.contexts.remove(parts[2]) is None:
                    return self._text(404, "Context %s not found" % parts[2])
                return self._send(200, None)
            if len(parts) == 4 and parts[1] == "contexts" and parts[3] == "restart" and method == "POST":
                ctx = self.contexts.get(parts[2])
                if ctx is None:
                    return self._text(404, "Context %s not found" % parts[2])
                ctx.restart()
                return self._send(200, None)
            return self._text(404, "Not Found")
        except BadRequest as e:
            return self._text(400, str(e))
        except ContextGone as e:
            return self._text(500, str(e))

    def do_GET(self):
        self._route("GET")

    def do_POST(self):
        self._route("POST")

    def do_DELETE(self):
        self._route("DELETE")

    def _create(self):
        body = self._body()
        lang = normalize_language(body.get("language"))
        if lang != "python":
            raise BadRequest("language: %r is not supported; this interpreter runs python only" % body.get("language"))
        cwd = body.get("cwd") or default_cwd()
        if not isinstance(cwd, str) or not os.path.isdir(cwd):
            raise BadRequest("cwd: %r is not an existing directory; create it first" % (cwd,))
        self._send(200, self.contexts.create(lang, cwd).info())

    def _execute(self):
        body = self._body()
        code = body.get("code")
        if not isinstance(code, str):
            raise BadRequest("code: missing or not a string; send the code to run")
        cid, lang = body.get("context_id"), body.get("language")
        if cid and lang:
            raise BadRequest("context_id and language: give only one of them")
        env_vars = body.get("env_vars") or {}
        if not isinstance(env_vars, dict):
            raise BadRequest("env_vars: must be an object of strings")
        if cid:
            ctx = self.contexts.get(cid)
            if ctx is None:
                return self._text(404, "Context %s not found" % cid)
        else:
            if normalize_language(lang) != "python":
                raise BadRequest("language: %r is not supported; this interpreter runs python only" % lang)
            ctx = self.contexts.get_default()

        self.send_response(200)
        self.send_header("Content-Type", "application/x-ndjson")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def emit(ev):
            data = (json.dumps(ev) + "\n").encode()
            try:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()
                return True
            except OSError:
                return False

        ctx.execute(code, env_vars, emit)
        if emit({"type": "end_of_execution"}):
            try:
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
            except OSError:
                pass
        else:
            self.close_connection = True


def serve(host, port):
    Handler.contexts = Contexts()
    ThreadingHTTPServer.daemon_threads = True
    ThreadingHTTPServer.allow_reuse_address = True
    srv = ThreadingHTTPServer((host, port), Handler)
    # The default context starts with the server, as E2B's does, so the
    # first execution does not pay for it; requests for it wait meanwhile.
    threading.Thread(target=Handler.contexts.get_default, daemon=True).start()
    srv.serve_forever()


def main(argv):
    if "--worker" in argv:
        worker_main()
        return
    if "--transform" in argv:  # a JSON list of cells in IPython syntax -> plain Python, for tests
        json.dump([transform_cell(c) for c in json.load(sys.stdin)], sys.stdout)
        return
    host, port = "127.0.0.1", 49999
    args = list(argv)
    while args:
        a = args.pop(0)
        if a == "--port" and args:
            port = int(args.pop(0))
        elif a == "--host" and args:
            host = args.pop(0)
        else:
            sys.exit("usage: interpreter.py [--host 127.0.0.1] [--port 49999]")
    serve(host, port)


if __name__ == "__main__":
    main(sys.argv[1:])
