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
import datetime
import io
import json
import linecache
import os
import queue
import subprocess
import sys
import threading
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


class Worker:
    def __init__(self, emitter):
        self.emitter = emitter
        self.count = 0
        self.ns = {"__name__": "__main__", "__builtins__": __builtins__}
        self.ns["display"] = self.display
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
        if isinstance(exc, SyntaxError):
            lines = traceback.format_exception_only(type(exc), exc)
        else:
            lines = traceback.format_exception(type(exc), exc, tb)
        self.emitter.send({"type": "error", "name": type(exc).__name__, "value": str(exc), "traceback": "".join(lines)})

    def execute(self, code, env_vars):
        self.count += 1
        self.emitter.send({"type": "number_of_executions", "execution_count": self.count})
        saved = {}
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
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def _run(self, code):
        name = "<cell %d>" % self.count
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
