"""The online loop grades model-written code in coderl's sandbox: a reply that tries to escape
(read a host file, write outside its workspace, open a network connection) cannot, and scores
False; the same replies run in a plain subprocess with the check (what the removed
``sandbox: local`` grader did) do escape, which shows the attacks are real. ``local`` itself is
refused everywhere online grading is configured. The grader is training's
(``coderl.grading.grade.grade``)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from coderl.config.online import check_sandbox
from coderl.grading.verdict import GradeResult
from coderl.online.suites import GradingError, SuiteTask, extract_code, passes, resolves

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
    replies = [extract_code(_reply(BODY.lstrip()))]
    replies += [extract_code(_reply(code)) for code in attacks.values()]
    assert [passes(ADD, code) for code in replies] == [True, False, False, False]
    assert not (tmp_path / "escaped.txt").exists()
    assert not _connected(listener)


def _in_interpreter(task: SuiteTask, code: str | None) -> bool:
    """What the removed ``local`` grader did: the check in the reply's own interpreter."""
    program = f"{task.prompt}\n{code}\n\n{task.test}\n\ncheck({task.entry_point})\n"
    proc = subprocess.run([sys.executable, "-I", "-c", program], capture_output=True, timeout=30)
    return proc.returncode == 0


def test_the_same_replies_escape_in_the_replys_own_interpreter(tmp_path: Path, listener) -> None:
    """Control: without isolation every attack works, so the sandboxed test above can fail."""
    attacks = _attacks(tmp_path, listener.getsockname()[1])
    assert [_in_interpreter(ADD, extract_code(_reply(c))) for c in attacks.values()] == [True] * 3
    assert (tmp_path / "escaped.txt").read_text() == "pwned"
    assert _connected(listener)


VERDICT_HACKS = {  # wrong answers that rewrite the check's outcome when they share its process
    "atexit_exit_0": "import atexit, os\natexit.register(lambda: os._exit(0))\n"
    "def add(a, b):\n    return 0\n",
    "excepthook_exit_0": "import sys, os\nsys.excepthook = lambda *a: os._exit(0)\n"
    "def add(a, b):\n    return 0\n",
}


@pytest.mark.parametrize("name", sorted(VERDICT_HACKS))
def test_local_grading_is_refused_and_its_verdict_hacks_fail_in_the_sandbox(name) -> None:
    """In the reply's interpreter a wrong answer passes (control); the online grader judges it
    outside (False), and ``local`` cannot be chosen anywhere."""
    code = VERDICT_HACKS[name]
    assert _in_interpreter(ADD, code)
    assert not _in_interpreter(ADD, "def add(a, b):\n    return 0\n")  # the honest wrong answer
    if shutil.which("bwrap") is not None and os.geteuid() == 0:
        assert not passes(ADD, code)
    with pytest.raises(ValueError, match=r"sandbox 'local' is refused.*valid: \['bwrap'\]"):
        check_sandbox("local")


def test_config_refuses_local_naming_the_key_and_the_valid_values() -> None:
    from pydantic import ValidationError

    from coderl.config.online import OnlineConfig

    assert OnlineConfig().sandbox == "bwrap"
    with pytest.raises(ValidationError) as info:
        OnlineConfig(sandbox="local")
    message = str(info.value)
    assert "online.sandbox='local'" in message and "valid: ['bwrap']" in message
    assert "trained on" in message


def test_simulated_population_refuses_local() -> None:
    """(The gate's evaluator has no sandbox option: it grades through the run's environment.)"""
    from coderl.config.online import SimulateConfig
    from coderl.online.simulate import SimulatedPopulation

    with pytest.raises(ValueError, match="sandbox 'local' is refused"):
        SimulatedPopulation("http://127.0.0.1:9/v1", SimulateConfig(), tasks=[ADD], sandbox="local")


@needs_sandbox
def test_wrong_crashing_or_hanging_code_scores_false_within_the_timeout() -> None:
    replies = [
        extract_code(_reply("def add(a, b):\n    return a - b\n")),
        extract_code(_reply("import sys\nsys.exit(0)\n" + BODY)),
        extract_code(_reply("def add(a, b):\n    while True:\n        pass\n")),
        "def plus(a, b):\n    return a + b\n",  # never defines the entry point
        None,  # no code block at all
    ]
    assert [passes(ADD, code, timeout_s=3.0) for code in replies] == [False] * 5  # cut at 3 s


def test_a_broken_grader_raises_instead_of_scoring(monkeypatch: pytest.MonkeyPatch) -> None:
    def sandbox_down(task, diff, **kwargs) -> GradeResult:
        return GradeResult(task_id=task.id, grading_error="SandboxError: bwrap missing")

    monkeypatch.setattr("coderl.online.suites.grade", sandbox_down)
    with pytest.raises(GradingError, match="t/add: the sandboxed grader failed .*bwrap missing"):
        passes(ADD, BODY)
    with pytest.raises(GradingError, match="bwrap missing"):  # an agent's diff, the same grader
        resolves(ADD, "--- a/solution.py\n+++ b/solution.py\n")
    with pytest.raises(ValueError, match=r"unknown grading sandbox 'docker'; valid: \['bwrap'"):
        check_sandbox("docker")


LONE_SURROGATE = "def add(a, b):\n    return a + b  # \ud800\n"
NUL = "def add(a, b):\n    return a + b  # \x00\n"


@needs_sandbox
def test_a_lone_surrogate_or_nul_is_an_ordinary_failure_in_the_sandbox() -> None:
    # code that is not valid text or source cannot run: the reply fails, nothing raises
    assert [passes(ADD, LONE_SURROGATE), passes(ADD, NUL)] == [False, False]
