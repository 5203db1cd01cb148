"""The online loop grades model-written code in coderl's sandbox: a reply that tries to escape
(read a host file, write outside its workspace, open a network connection) cannot, and scores
False; the same replies graded with the explicit ``sandbox="local"`` escape hatch do escape,
which shows the attacks are real."""

from __future__ import annotations

import os
import shutil
import socket
import time
import warnings
from pathlib import Path

import pytest

from coderl.online.suites import GradingError, SuiteTask, extract_code, grade_replies, passes
from coderl.sandbox.local import UnisolatedSandboxWarning
from coderl.tasks.grading import GradeResult

needs_sandbox = pytest.mark.skipif(
    shutil.which("bwrap") is None or os.geteuid() != 0,
    reason="needs bubblewrap and root (make sysdeps); CI has both",
)
ADD = SuiteTask(
    "t/add",
    'def add(a, b):\n    """a + b"""\n',
    "def check(f):\n    assert f(2, 3) == 5\n",
    "add",
    "    return a + b\n",
)
BODY = "\n\ndef add(a, b):\n    return a + b\n"


def _reply(code: str) -> str:
    """A model reply the way the loop sees it: prose and one fenced block."""
    return f"Here is the function:\n\n```python\n{code}```\n"


@pytest.fixture
def listener():
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(0.5)
    yield srv
    srv.close()


def _attacks(tmp_path: Path, port: int) -> dict[str, str]:
    """Replies whose function is right only if the escape works (else they crash at import)."""
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cret")
    return {
        "read_host_file": f"assert open({str(secret)!r}).read() == 's3cret'" + BODY,
        "write_outside": f"open({str(tmp_path / 'escaped.txt')!r}, 'w').write('pwned')" + BODY,
        "network": (
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=3)"
            ".sendall(b'hi')" + BODY
        ),
    }


def _connected(srv: socket.socket) -> bool:
    try:
        conn, _ = srv.accept()
    except TimeoutError:
        return False
    conn.close()
    return True


@needs_sandbox
def test_escaping_replies_score_false_in_the_sandbox(tmp_path: Path, listener) -> None:
    attacks = _attacks(tmp_path, listener.getsockname()[1])
    replies = [(ADD, extract_code(_reply(BODY.lstrip())))]
    replies += [(ADD, extract_code(_reply(code))) for code in attacks.values()]
    assert grade_replies(replies) == [True, False, False, False]
    assert not (tmp_path / "escaped.txt").exists()
    assert not _connected(listener)
    # the population's path (one reply at a time) grades the same way
    assert not passes(ADD, extract_code(_reply(attacks["read_host_file"])))


def test_the_same_replies_escape_with_sandbox_local(tmp_path: Path, listener) -> None:
    """Control: without isolation every attack works, so the sandboxed test above can fail."""
    attacks = _attacks(tmp_path, listener.getsockname()[1])
    replies = [(ADD, extract_code(_reply(code))) for code in attacks.values()]
    with pytest.warns(UnisolatedSandboxWarning, match="WITHOUT ISOLATION"):
        assert grade_replies(replies, sandbox="local") == [True, True, True]
    assert (tmp_path / "escaped.txt").read_text() == "pwned"
    assert _connected(listener)


@needs_sandbox
def test_wrong_crashing_or_hanging_code_scores_false_within_the_timeout() -> None:
    replies = [
        (ADD, extract_code(_reply("def add(a, b):\n    return a - b\n"))),
        (ADD, extract_code(_reply("import sys\nsys.exit(0)\n" + BODY))),
        (ADD, extract_code(_reply("def add(a, b):\n    while True:\n        pass\n"))),
        (ADD, "def plus(a, b):\n    return a + b\n"),  # never defines the entry point
        (ADD, None),  # no code block at all
    ]
    assert grade_replies(replies, timeout_s=3.0) == [False] * 5  # the loop is cut at 3 s


def test_a_broken_grader_raises_instead_of_scoring(monkeypatch: pytest.MonkeyPatch) -> None:
    def sandbox_down(task, completion, **kwargs) -> GradeResult:
        return GradeResult(task_id=task.id, grading_error="SandboxError: bwrap missing")

    monkeypatch.setattr("coderl.online.suites.grade_completion", sandbox_down)
    with pytest.raises(GradingError, match="t/add: the sandboxed grader failed .*bwrap missing"):
        grade_replies([(ADD, BODY)])
    with pytest.raises(ValueError, match=r"unknown grading sandbox 'docker'; valid: \['bwrap'"):
        grade_replies([(ADD, BODY)], sandbox="docker")


def _dead(pid: int) -> bool:
    """The process is gone, or a zombie waiting for a parent that is not this test."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _spawner(pidfile: Path, then: str) -> str:
    """Reply code that starts a background ``sleep`` (pid written to ``pidfile``), then ``then``."""
    return (
        "import subprocess, sys\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        f"open({str(pidfile)!r}, 'w').write(str(p.pid))\n" + then + BODY
    )


@pytest.mark.parametrize("then", ["import time\ntime.sleep(120)\n", ""], ids=["hangs", "passes"])
def test_local_grader_kills_what_the_reply_left_running(tmp_path: Path, then: str) -> None:
    pidfile = tmp_path / "pid"
    with pytest.warns(UnisolatedSandboxWarning):
        [ok] = grade_replies([(ADD, _spawner(pidfile, then))], sandbox="local", timeout_s=3.0)
    assert ok == (then == "")  # a hang times out; the other passes (and returns at once)
    pid = int(pidfile.read_text())
    for _ in range(50):  # SIGKILL is delivered asynchronously: allow it a moment
        if _dead(pid):
            break
        time.sleep(0.1)
    assert _dead(pid), "the reply's background process outlived its grade"


LONE_SURROGATE = "def add(a, b):\n    return a + b  # \ud800\n"
NUL = "def add(a, b):\n    return a + b  # \x00\n"


@needs_sandbox
def test_a_lone_surrogate_or_nul_is_an_ordinary_failure_in_the_sandbox() -> None:
    # code that is not valid text or source cannot run: the reply fails, nothing raises
    assert grade_replies([(ADD, LONE_SURROGATE), (ADD, NUL)]) == [False, False]


def test_a_lone_surrogate_or_nul_is_an_ordinary_failure_locally() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnisolatedSandboxWarning)
        assert grade_replies([(ADD, LONE_SURROGATE), (ADD, NUL)], sandbox="local") == [
            False,
            False,
        ]
