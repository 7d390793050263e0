"""The templates E2B users start without naming one: `base` (Sandbox.create())
is root/base and `code-interpreter-v1` (the code-interpreter SDK's default)
is root/code-interpreter, both built offline by deploy/images/build.sh."""

from e2b import Sandbox
from e2b_code_interpreter import Sandbox as CISandbox


def test_base_has_e2b_tools(sandbox):
    assert sandbox.get_info().name == "base"
    for cmd, want in [
        ("git --version", "git version "),
        ("curl --version", "curl "),
        ("wget --version", "GNU Wget"),
        ("python --version", "Python 3.11"),
        ("python -m pip --version", "pip "),
        ("node --version", "v18."),
        ("npm --version", "9."),
        ("ip -V", "ip utility"),
        ("nc -h 2>&1 || true", "OpenBSD netcat"),
        ("ps -p 1 -o comm=", ""),
    ]:
        r = sandbox.commands.run(cmd)
        assert r.exit_code == 0 and want in r.stdout, (cmd, r.stdout, r.stderr)
    assert sandbox.commands.run("id -un").stdout == "user\n"
    # user may run anything as root without a password (sudoers.d/user).
    assert "NOPASSWD: ALL" in sandbox.commands.run("cat /etc/sudoers.d/user", user="root").stdout
    assert sandbox.commands.run("sudo -n id -un", user="root").stdout == "root\n"


def test_base_sudo_as_user(sandbox):
    # E2B sandboxes allow privilege escalation (no no_new_privs), as E2B's do.
    assert sandbox.commands.run("sudo -n true").exit_code == 0
    assert sandbox.commands.run("sudo -n id -u").stdout == "0\n"


def test_base_pip_installs_are_allowed(sandbox):
    # Not marked externally managed, as in E2B's images: pip tries the index
    # (unreachable from the test's network) instead of refusing.
    r = sandbox.commands.run("pip install --no-index nosuchpkg-xyz 2>&1 || true")
    assert "externally-managed-environment" not in r.stdout, r.stdout
    assert "No matching distribution found for nosuchpkg-xyz" in r.stdout, r.stdout


def test_code_interpreter_default_template(test_id):
    ci = CISandbox.create(metadata={"sandbox_test_id": test_id})
    try:
        assert ci.get_info().name == "code-interpreter-v1"
        ex = ci.run_code("import numpy, pandas, matplotlib, PIL\n(numpy.__name__, pandas.__name__, matplotlib.__name__, PIL.__name__)")
        assert ex.error is None, ex.error
        assert ex.text == "('numpy', 'pandas', 'matplotlib', 'PIL')"
        ex = ci.run_code("!echo hi")
        assert ex.error is None, ex.error
        assert ex.logs.stdout == ["hi\n"], ex.logs
        ex = ci.run_code("import pandas as pd\npd.DataFrame({'a': [1, 2]})['a'].sum()")
        assert ex.error is None and ex.text == "3", (ex.error, ex.text)
        ex = ci.run_code("import matplotlib.pyplot as plt\nplt.plot([1, 2]); plt.savefig('/tmp/p.png'); import os; os.path.getsize('/tmp/p.png') > 0")
        assert ex.error is None and ex.text == "True", (ex.error, ex.text)
        # The base tools are there too.
        assert ci.commands.run("node --version").stdout.startswith("v18.")
    finally:
        ci.kill()


def test_py_still_starts(test_id):
    # root/py:3.11 stays as it was: python3, no pip (root/busybox, which has
    # no bash for the SDK's commands, is started in test_code_interpreter).
    sbx = Sandbox.create(template="root/py:3.11", metadata={"sandbox_test_id": test_id})
    try:
        assert sbx.commands.run("python3 -c 'print(6*7)'").stdout == "42\n"
        assert sbx.commands.run("python3 -m pip --version 2>&1 || true").stdout.endswith("No module named pip\n")
    finally:
        sbx.kill()
