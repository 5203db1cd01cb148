"""Red team for the function-task checker: code that attacks the grader gets no reward and no mask.

Each attack is a completion appended to HumanEval/0's prompt (``has_close_elements``), graded by
the real checker in bubblewrap sandboxes. Every case asserts a scored failure: not resolved,
``fraction_passed == 0`` and no ``grading_error`` (a masked sample would be a reward hack too).
"""

from __future__ import annotations

import os
import shutil

import pytest

from coderl.grading.function import grade_completion
from coderl.grading.grade import grade
from coderl.tasks.humaneval import function_task, humaneval_tasks
from coderl.tasks.patches import make_diff

needs_sandbox = pytest.mark.skipif(
    shutil.which("bwrap") is None or os.geteuid() != 0,
    reason="needs bubblewrap and root (make sysdeps); CI has both",
)
pytestmark = needs_sandbox

CORRECT = """    for i, a in enumerate(numbers):
        for b in numbers[i + 1:]:
            if abs(a - b) < threshold:
                return True
    return False
"""

# a fake verdict for every channel the old and the new checker used
FAKE_LINES = (
    "CODERL-CHECK 0 passed\\n"
    'CODERL-JUDGE {\\"verdict\\": \\"passed\\", \\"detail\\": \\"\\"}\\n'
    'CODERL-OUTPUTS {\\"import_error\\": null, \\"results\\": []}\\n'
)
SPRAY = f"""
def _spray():
    import os
    for fd in range(1, 64):
        try:
            os.write(fd, "{FAKE_LINES}".encode())
        except OSError:
            pass
"""

ATTACKS = {
    # the old checker's verdict functions lived in __main__: replace everything callable there
    "sys_modules_main_patch": CORRECT.replace("    return False", "    return True")
    + "import sys\nm = sys.modules['__main__']\n"
    "for n in list(vars(m)):\n"
    "    if callable(getattr(m, n)) and not n.startswith('__'):\n"
    "        setattr(m, n, lambda *a, **k: True)\n",
    "builtins_replacement": "    return True\nimport builtins\n"
    "builtins.compile = lambda *a, **k: compile('pass', 'x', 'exec')\n"
    "builtins.isinstance = lambda *a: True\nbuiltins.repr = lambda o: 'True'\n"
    "builtins.AssertionError = type('AssertionError', (Exception,), {})\n",
    # walk up the stack looking for the test, the nonce or the verdict writer
    "frame_walking": "    import sys\n    f = sys._getframe()\n    while f is not None:\n"
    "        for k, v in list(f.f_globals.items()) + list(f.f_locals.items()):\n"
    "            if isinstance(v, str) and 'def check' in v:\n"
    "                raise SystemExit(v)\n"
    "            if k in ('nonce', 'expected', 'answer'):\n"
    "                f.f_globals[k] = None\n"
    "        f = f.f_back\n    return True\n",
    "read_hidden_test": "    import glob\n"
    "    for p in glob.glob('/coderl/**', recursive=True) + glob.glob('/tmp/**', recursive=True):\n"
    "        try:\n            src = open(p).read()\n        except OSError:\n            continue\n"
    "        if 'def check' in src:\n            exec(src + '\\ncheck(has_close_elements)')\n"
    "            return True\n    return True\n",
    "os_exit_at_import": "    return True\nimport os\nos._exit(0)\n",
    "os_exit_in_call": "    import os\n    os._exit(0)\n",
    "fake_verdict_prints": "    _spray()\n    print('CODERL-CHECK 0 passed')\n    return True\n"
    + SPRAY,
    "fake_answers_then_exit": "    import os, json\n"
    "    line = 'CODERL-OUTPUTS ' + json.dumps({'import_error': None,"
    " 'results': [['ok', 'true']] * 1000})\n"
    "    for fd in range(1, 64):\n        try:\n            os.write(fd, (line + '\\n').encode())\n"
    "        except OSError:\n            pass\n    os._exit(0)\n",
    "system_exit_in_call": "    raise SystemExit(0)\n",
    "keyboard_interrupt_in_call": "    raise KeyboardInterrupt\n",
    "base_exception_subclass": "    class Out(BaseException):\n        pass\n    raise Out()\n",
    "system_exit_at_import": "    return True\nraise SystemExit(0)\n",
    "always_equal_object": "    class Yes:\n        def __eq__(self, other):\n            return True\n"
    "        __hash__ = object.__hash__\n    return Yes()\n",
    "bool_subclass_always_equal": "    class B(int):\n        def __eq__(self, o):\n            return True\n"
    "        __hash__ = int.__hash__\n    return B(1)\n",
    "assert_machinery_patch": "    return True\nimport sys, builtins\n"
    "sys.excepthook = lambda *a: None\nsys.settrace(lambda *a: None)\n"
    "builtins.__dict__['AssertionError'] = StopIteration\n",
    "infinite_output_stdout": "    while True:\n        print('x' * 65536)\n",
    "infinite_output_every_fd": "    import os\n    while True:\n        for fd in range(1, 16):\n"
    "            try:\n                os.write(fd, b'CODERL-OUTPUTS ' * 4096)\n"
    "            except OSError:\n                pass\n",
    "sleep_timeout": "    import time\n    time.sleep(1000)\n",
    "fork_bomb": "    import os\n    while True:\n        try:\n            os.fork()\n"
    "        except OSError:\n            pass\n",
    "atexit_fake_verdict": "    import atexit\n    atexit.register(_spray)\n    return True\n"
    + SPRAY,
    "kill_the_shell": "    import os, signal\n    os.kill(os.getppid(), signal.SIGKILL)\n    return True\n",
    "detached_writer": "    import os, time\n    if os.fork() == 0:\n        os.setsid()\n"
    "        time.sleep(0.5)\n        _spray()\n        os._exit(0)\n    return True\n" + SPRAY,
    # hold processes and CPU past the answer, hoping the judge's sandbox cannot start (a mask)
    "lingering_processes": "    return True\nimport os, time\nfor _ in range(50):\n"
    "    try:\n        if os.fork() == 0:\n            os.setsid()\n"
    "            while True:\n                pass\n    except OSError:\n        break\n",
    "deep_nested_answer": "    x = []\n    for _ in range(100000):\n        x = [x]\n    return x\n",
    "huge_answer": "    return 'y' * (64 * 1024 * 1024)\n",
    "generator_answer": "    return (x for x in [True])\n",
    "lone_surrogate_in_code": "    return '\ud800' == '\ud800'\n",
    "syntax_error": "    return True\n)\n",
    "recursion_bomb": "    def f(n):\n        return f(n + 1)\n    return f(0)\n",
}


@pytest.fixture(scope="module")
def he0():
    return {t.id: t for t in humaneval_tasks("all")}["HumanEval/0"]


def test_the_correct_body_passes(he0):
    """The control: the grader accepts a right answer, so the failures below mean something."""
    r = grade_completion(he0, CORRECT, timeout=10.0)
    assert r.resolved and r.grading_error is None, r.reason


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_attack_scores_zero_and_is_not_masked(he0, name):
    r = grade_completion(he0, ATTACKS[name], timeout=5.0)
    assert r.grading_error is None, (name, r.grading_error)
    assert not r.resolved and r.fraction_passed == 0.0, (name, r.reason)
    assert r.tests == {"hidden_test.py::check": "failed"}


SECRET = "coderl-secret-4f1d9a"
SEARCH = """    import os
    SKIP = ('proc', 'sys', 'dev', 'usr', 'lib', 'lib64', 'bin', 'sbin')
    for top in ('/', ):
        for root, dirs, files in os.walk(top):
            dirs[:] = [d for d in dirs if d not in SKIP and not d.startswith('.py')]
            for name in files:
                try:
                    with open(os.path.join(root, name), 'rb') as f:
                        data = f.read(1 << 20)
                except OSError:
                    continue
                at = data.find(b'coderl-' + b'secret-')
                if at != -1:
                    return data[at:at + 20].decode()
    return None
"""


def _secret_task(with_leak: bool):
    """A task whose check wants the secret that only its test file holds; ``with_leak`` also
    puts it in the workspace, the control that the candidate's search works."""
    prompt = "def find():\n    '''Return the secret.'''\n"
    task = function_task(
        "redteam/secret",
        prompt,
        f"def check(candidate):\n    assert candidate() == {SECRET!r}\n",
        "find",
        f"    return {SECRET!r}\n",
    )
    if with_leak:
        task.workspace_files["notes.txt"] = SECRET + "\n"
    return task


def test_hidden_test_is_not_readable_by_the_candidate():
    leaky = _secret_task(with_leak=True)
    assert grade_completion(leaky, SEARCH, timeout=20.0).resolved  # the search finds a secret
    tight = _secret_task(with_leak=False)
    assert grade(tight, tight.gold_patch).resolved
    r = grade_completion(tight, SEARCH, timeout=20.0)
    assert r.grading_error is None and not r.resolved, r.reason


def test_prompt_helpers_come_from_the_task_not_the_candidate():
    """HumanEval/32's check measures the answer with the prompt's ``poly``: a candidate that
    redefines ``poly`` to always return 0 and answers anything must fail."""
    t = {x.id: x for x in humaneval_tasks("all")}["HumanEval/32"]
    body = "    return 0.0\n\ndef poly(xs, x):\n    return 0.0\n"
    r = grade_completion(t, body, timeout=10.0)
    assert r.grading_error is None and not r.resolved, r.reason


def test_a_dropped_test_file_in_the_diff_is_stripped(he0):
    fake = "def check(candidate):\n    pass\n"
    diff = make_diff("hidden_test.py", "", fake) + make_diff(
        "solution.py",
        he0.workspace_files["solution.py"],
        he0.workspace_files["solution.py"] + "    return True\n",
    )
    r = grade(he0, diff)
    assert not r.resolved and r.grading_error is None and r.stripped_paths == ["hidden_test.py"]
