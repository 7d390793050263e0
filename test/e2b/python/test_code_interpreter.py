"""The unmodified e2b-code-interpreter SDK against OpenDsec's runner on port 49999."""

import pytest
from e2b import SandboxException as E2BSandboxException
from e2b_code_interpreter import AsyncSandbox, Sandbox


@pytest.fixture
def ci(test_id):
    sbx = Sandbox.create(metadata={"sandbox_test_id": test_id})
    try:
        yield sbx
    finally:
        sbx.kill()


def test_run_code_keeps_state(ci):
    first = ci.run_code("x = 1")
    assert first.error is None and first.results == []
    ex = ci.run_code("x + 1")
    assert ex.error is None
    assert ex.text == "2"
    assert ex.results[0].is_main_result
    assert ex.execution_count == first.execution_count + 1


def test_run_code_error(ci):
    ex = ci.run_code("def f():\n    raise ValueError('bad value')\nf()")
    assert ex.error is not None
    assert ex.error.name == "ValueError"
    assert ex.error.value == "bad value"
    assert "raise ValueError('bad value')" in ex.error.traceback
    # The context survives the error.
    assert ci.run_code("40 + 2").text == "42"


def test_run_code_logs_and_callbacks(ci):
    seen = []
    ex = ci.run_code(
        "import sys\nprint('hello')\nprint('oops', file=sys.stderr)",
        on_stdout=lambda m: seen.append(m.line),
    )
    assert ex.logs.stdout == ["hello\n"]
    assert ex.logs.stderr == ["oops\n"]
    assert seen == ["hello\n"]


def test_run_code_rich_result_and_env(ci):
    ex = ci.run_code(
        "class T:\n"
        "    def _repr_html_(self): return '<table></table>'\n"
        "    def __repr__(self): return 'T()'\n"
        "T()"
    )
    assert ex.results[0].html == "<table></table>"
    assert ex.results[0].text == "T()"
    ex = ci.run_code("import os; os.environ['CI_ENV']", envs={"CI_ENV": "set"})
    assert ex.text == "'set'"
    ex = ci.run_code("import getpass, os; (getpass.getuser(), os.getcwd())")
    assert ex.text == "('user', '/home/user')"


def test_contexts_isolate_variables(ci):
    ci.run_code("secret = 1")
    ctx = ci.create_code_context(cwd="/tmp")
    assert ctx.language == "python" and ctx.cwd == "/tmp"
    ex = ci.run_code("'secret' in globals()", context=ctx)
    assert ex.text == "False"
    ci.run_code("y = 5", context=ctx)
    assert ci.run_code("y", context=ctx).text == "5"
    assert ctx.id in [c.id for c in ci.list_code_contexts()]
    ci.restart_code_context(ctx)
    assert ci.run_code("y", context=ctx).error.name == "NameError"
    ci.remove_code_context(ctx)
    assert ctx.id not in [c.id for c in ci.list_code_contexts()]
    with pytest.raises(E2BSandboxException):  # NotFoundException
        ci.run_code("1", context=ctx)
    # The default context still has its variable.
    assert ci.run_code("secret").text == "1"


def test_image_without_python(test_id):
    sbx = Sandbox.create(template="root/busybox", metadata={"sandbox_test_id": test_id})
    try:
        with pytest.raises(E2BSandboxException) as exc:
            sbx.run_code("1")
        assert "503" in str(exc.value) and "python3" in str(exc.value)
    finally:
        sbx.kill()


async def test_async_run_code(test_id):
    sbx = await AsyncSandbox.create(metadata={"sandbox_test_id": test_id})
    try:
        await sbx.run_code("z = 20")
        ex = await sbx.run_code("z * 2 + 2")
        assert ex.text == "42"
    finally:
        await sbx.kill()


def test_rich_results(ci):
    ex = ci.run_code(
        "class R:\n"
        "    def _repr_html_(self): return '<b>bold</b>'\n"
        "    def _repr_markdown_(self): return '**bold**'\n"
        "    def _repr_svg_(self): return '<svg></svg>'\n"
        "    def _repr_png_(self): return b'\\x89PNG fake'\n"
        "    def _repr_json_(self): return {'a': [1, 2]}\n"
        "    def _repr_latex_(self): return r'$x^2$'\n"
        "    def __repr__(self): return 'R()'\n"
        "R()"
    )
    assert ex.error is None
    r = ex.results[0]
    assert r.is_main_result
    assert (r.text, r.html, r.markdown, r.svg, r.latex) == ("R()", "<b>bold</b>", "**bold**", "<svg></svg>", "$x^2$")
    import base64

    assert base64.b64decode(r.png) == b"\x89PNG fake"
    assert r.json == {"a": [1, 2]}
    assert set(r.formats()) >= {"html", "markdown", "svg", "png", "json", "latex"}
    # A dict is a plain-text result; display() adds non-main results.
    ex = ci.run_code("d = {'k': [1, 2], 's': 'v'}\nd")
    assert ex.text == "{'k': [1, 2], 's': 'v'}"
    ex = ci.run_code("display('shown'); 7")
    texts = [(r.is_main_result, r.text) for r in ex.results]
    assert (False, "'shown'") in texts and (True, "7") in texts


def test_error_kinds_and_execution_count(ci):
    ex = ci.run_code("undefined_name + 1")
    assert ex.error.name == "NameError" and "undefined_name" in ex.error.value
    ex = ci.run_code("def f(:\n  pass")
    assert ex.error.name == "SyntaxError"
    ex = ci.run_code("print('before'); 1/0")
    assert ex.error.name == "ZeroDivisionError" and ex.logs.stdout == ["before\n"]
    assert "ZeroDivisionError" in ex.error.traceback
    a = ci.run_code("1").execution_count
    b = ci.run_code("2").execution_count
    assert b == a + 1


def test_contexts_restart_keeps_id(ci):
    ctx = ci.create_code_context()
    ci.run_code("v = 'kept'", context=ctx)
    assert ci.run_code("v", context=ctx).text == "'kept'"
    ci.restart_code_context(ctx.id)
    assert ci.run_code("v", context=ctx).error.name == "NameError"
    assert ci.run_code("import os; os.getcwd()", context=ctx).text == "'/home/user'"
    ci.remove_code_context(ctx.id)
    ids = [c.id for c in ci.list_code_contexts()]
    assert ctx.id not in ids


async def test_async_code_interpreter_full(test_id):
    sbx = await AsyncSandbox.create(metadata={"sandbox_test_id": test_id})
    try:
        ex = await sbx.run_code("raise RuntimeError('async boom')")
        assert ex.error.name == "RuntimeError" and ex.error.value == "async boom"
        ex = await sbx.run_code("class H:\n    def _repr_html_(self): return '<i>a</i>'\nH()")
        assert ex.results[0].html == "<i>a</i>"
        ctx = await sbx.create_code_context(cwd="/tmp")
        await sbx.run_code("n = 3", context=ctx)
        assert (await sbx.run_code("n * 2", context=ctx)).text == "6"
        assert ctx.id in [c.id for c in await sbx.list_code_contexts()]
        await sbx.restart_code_context(ctx)
        assert (await sbx.run_code("n", context=ctx)).error.name == "NameError"
        await sbx.remove_code_context(ctx)
        assert ctx.id not in [c.id for c in await sbx.list_code_contexts()]
        out = []
        ex = await sbx.run_code("print('streamed')", on_stdout=lambda m: out.append(m.line))
        assert out == ["streamed\n"]
    finally:
        await sbx.kill()


def test_run_code_ipython_shell_lines(ci):
    # E2B's interpreter is Jupyter: IPython's escapes work, output streamed.
    ex = ci.run_code("!echo hi")
    assert ex.error is None, ex.error
    assert ex.logs.stdout == ["hi\n"]
    ex = ci.run_code("n = 2\nfor i in range(n):\n    !echo line $i {i * 10}\nlines = !printf 'a\\nb\\n'\nlines")
    assert ex.error is None, ex.error
    assert "".join(ex.logs.stdout) == "line 0 0\nline 1 10\n"
    assert ex.text == "['a', 'b']"
    ex = ci.run_code("!exit 3\n_exit_code")
    assert ex.error is None and ex.text == "3"
    ex = ci.run_code("%%bash\necho from bash\necho oops >&2")
    assert ex.error is None, ex.error
    assert ex.logs.stdout == ["from bash\n"] and ex.logs.stderr == ["oops\n"]
    ex = ci.run_code("%cd /tmp\n%env CI_K=v\nimport os\n(os.getcwd(), os.environ['CI_K'])")
    assert ex.error is None, ex.error
    assert ex.text == "('/tmp', 'v')"
    ex = ci.run_code("%nosuchmagic x")
    assert ex.error is not None and ex.error.name == "UsageError"
    assert ex.error.value == "Line magic function `%nosuchmagic` not found."


def test_run_code_pip_install_without_network(ci, test_id):
    # The test's sandboxes reach no index: pip fails with its own message,
    # streamed as the cell's output (IPython sets no error for a failing
    # shell line, only _exit_code).
    ex = ci.run_code("%pip install nosuchpkg-xyz", timeout=300)
    out = "".join(ex.logs.stdout + ex.logs.stderr)
    assert ex.error is None, ex.error
    assert "No matching distribution found for nosuchpkg-xyz" in out, out
    assert ci.run_code("_exit_code").text == "1"
    # What is installed satisfies pip without an index (smolagents' line).
    ex = ci.run_code("!pip install pillow numpy", timeout=300)
    assert "Requirement already satisfied: numpy" in "".join(ex.logs.stdout), ex.logs
    assert ci.run_code("_exit_code").text == "0"
    # root/py:3.11 has no pip: python's own message, still no SyntaxError.
    bare = Sandbox.create(template="root/py:3.11", metadata={"sandbox_test_id": test_id})
    try:
        ex = bare.run_code("%pip install nosuchpkg-xyz")
        assert ex.error is None, ex.error
        assert "No module named pip" in "".join(ex.logs.stderr), ex.logs
    finally:
        bare.kill()
