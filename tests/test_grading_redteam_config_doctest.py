"""Ninth attack round, configuration files and doctests (``docs/tasks-and-grading.md``).

1. The graded pytest run reads only a configuration file the grader names with ``-c``
   (``coderl.grading.pytestcfg``): for an environment that records none, a ``pytest.toml`` or a
   nested ``pkg/pytest.ini`` the agent adds was the run's configuration (its ``pythonpath``
   shadowed a standard-library module and resolved an unfixed toolz task). Every name pytest
   reads is protected at any depth.
2. Doctest examples are code: the guard skipped docstrings, and toolz's own suite runs them
   (a ``>>> flip.func.__code__ = ...`` line resolved an unfixed toolz task). Every example in
   every string literal the change adds (and in a text file a test may pass to
   ``doctest.testfile``) is scanned with the rules of code, and docstring text made at run
   time (``f.__doc__ = chr(62) * 3 + ...``, any ``__test__``) is a finding (``doctest-text``).

CI builds only six, whose run has a recorded configuration (``setup.cfg``), so the sandboxed
tests here run six as an environment without one: a copy of its snapshot whose ``setup.cfg``
has no ``[tool:pytest]`` section. The toolz replays are ``bench/redteam_config_doctest.py``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
from pathlib import Path

import pytest

from coderl.grading.diffguard import added_findings
from coderl.grading.grade import grade, rollout_base
from coderl.grading.guardproc import byproduct
from coderl.grading.protected import is_protected
from coderl.grading.pytestcfg import EMPTY_CONFIG, run_config
from coderl.grading.runner import pytest_command
from coderl.tasks.patches import make_diff
from coderl.tasks.snapshot import cache_dir
from coderl.tasks.spec import load_tasks

CI_SPEC = "six==1.17.0"
CI_TASKS = Path(__file__).parent.parent / "data" / "tasks" / "ci.jsonl"
sandboxed = pytest.mark.skipif(
    shutil.which("bwrap") is None or os.geteuid() != 0,
    reason="needs bubblewrap and root (make sysdeps); CI has both",
)


def new_file(path: str, text: str) -> str:
    return make_diff(path, None, text)


# --- class 1: configuration files -----------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        "pytest.toml",
        ".pytest.toml",
        "toolz/pytest.ini",
        "toolz/.pytest.ini",
        "toolz/pytest.toml",
        "toolz/tox.ini",
        "toolz/setup.cfg",
        "src/pkg/pyproject.toml",
    ],
)
def test_every_name_pytest_reads_as_configuration_is_protected_at_any_depth(path: str) -> None:
    assert is_protected(path)


def test_the_run_always_names_its_configuration() -> None:
    none = pytest_command(["tests"])
    assert f"-c {EMPTY_CONFIG} --confcutdir=/testbed" in none and "--rootdir=/testbed" in none
    assert "-c /testbed/setup.cfg" in pytest_command(["test_six.py"], inifile="setup.cfg")


def test_run_config_is_the_file_pytest_finds_in_the_pristine_tree(tmp_path: Path) -> None:
    (tmp_path / "pkg" / "tests").mkdir(parents=True)
    (tmp_path / "setup.cfg").write_text("[metadata]\nname = pkg\n")  # no pytest section
    assert run_config(tmp_path, None, ["pkg/tests"]) is None
    assert run_config(tmp_path, "setup.cfg", ["pkg/tests"]) == "setup.cfg"  # recorded wins
    (tmp_path / "tox.ini").write_text("[pytest]\naddopts = -q\n")
    assert run_config(tmp_path, None, ["pkg/tests"]) == "tox.ini"
    (tmp_path / "pkg" / "setup.cfg").write_text("[tool:pytest]\n")
    assert run_config(tmp_path, None, ["pkg/tests/test_a.py"]) == "pkg/setup.cfg"
    (tmp_path / "pkg" / "pytest.toml").write_text("")  # pytest 9: first, even empty
    assert run_config(tmp_path, None, ["pkg/tests"]) == "pkg/pytest.toml"
    assert run_config(tmp_path, None, ["pkg/tests", "other"]) == "tox.ini"


@pytest.fixture(scope="module")
def noconfig():
    """``(env, task)``: six as an environment that records no pytest configuration and whose
    snapshot has none (its ``setup.cfg`` without ``[tool:pytest]``), so nothing but ``-c``
    keeps pytest from discovering one in the graded tree."""
    from coderl.envbuild.build import build_env

    env = build_env(CI_SPEC)
    src = Path(env.snapshot)
    cfg = (src / "setup.cfg").read_text().replace("[tool:pytest]\nminversion = 2.2.0\n", "")
    assert "pytest" not in cfg
    # the bases cache is keyed by the snapshot's name: one per content, reused across runs
    name = "six-noconfig-" + hashlib.sha256((env.snapshot_digest + cfg).encode()).hexdigest()[:12]
    copy = cache_dir() / "snapshots" / name
    if not copy.is_dir():
        staging = copy.with_name(copy.name + f".{os.getpid()}")
        shutil.copytree(src, staging, symlinks=True)
        (staging / "setup.cfg").chmod(0o644)
        (staging / "setup.cfg").write_text(cfg)
        staging.rename(copy)
    info = {**env.info, "pytest_config": None}
    return dataclasses.replace(env, snapshot=str(copy), info=info), load_tasks(CI_TASKS)[0]


@sandboxed
def test_gold_patch_resolves_without_a_recorded_configuration(noconfig) -> None:
    env, task = noconfig
    result = grade(task, task.gold_patch, env=env)
    assert result.grading_error is None and result.resolved, result.reason


@sandboxed
@pytest.mark.parametrize("name", ["pytest.toml", ".pytest.toml"])
def test_an_agents_pytest_configuration_is_not_read(noconfig, name: str) -> None:
    """The agent's file deselects a PASS_TO_PASS test; read, it would report it missing."""
    env, task = noconfig
    victim = task.PASS_TO_PASS[0]
    text = f'[pytest]\naddopts = ["--deselect", "{victim}"]\n'
    result = grade(task, task.gold_patch + new_file(name, text), env=env)
    assert result.tests[victim] == "passed", result.reason
    assert result.resolved and result.grading_error is None
    assert result.stripped_paths == [name]  # applied, then put back (protected)


# --- class 2: doctests --------------------------------------------------------------------

BASE = b'def flip(f, a, b):\n    """Flip.\n\n    >>> flip(pow, 2, 3)\n    9\n    """\n    return f(b, a)\n'
PATCH = "    >>> flip.__code__ = (lambda f, a, b: f(a, b)).__code__\n"


def _with(example: str, old: bytes = BASE) -> bytes:
    return old.replace(b"    9\n", b"    9\n" + example.encode())


@pytest.mark.parametrize(
    "new",
    [
        _with(PATCH),  # a docstring example
        _with("    >>> import sys as s\n    >>> x = s._getframe(0)\n"),  # across examples
        _with("    >>> if True:\n    ...     flip.__code__ = None\n"),  # in a continuation
        BASE + b'__test__ = {"t": """\n>>> import gc\n>>> gc.get_objects()\n"""}\n',
        BASE + b'X = ">>> import g" + "c"\n',  # a string built from literals
        BASE + b"X = '''\n>>> Y = \">>> import gc\"\n'''\n",  # a doctest in a doctest
    ],
)
def test_a_doctest_example_is_scanned_as_code(new: bytes) -> None:
    found = added_findings(BASE, new, "pkg/flip.py")
    assert any("<doctest>" in f.scope for f in found), found


@pytest.mark.parametrize(
    "extra",
    [
        b'flip.__doc__ = chr(62) * 3 + " import gc"\n',
        b'flip.__doc__ = "%s import gc" % (chr(62) * 3)\n',
        b'setattr(flip, "__doc__", chr(62) * 3)\n',
        b"class C:\n    __doc__ = bytes([62, 62, 62]).decode()\n",
        b"class C:\n    def __doc__(self):\n        return chr(62) * 3\n",
        b'__test__ = {"t": chr(62) * 3 + " import gc"}\n',
        b"P = chr(62) * 3\n__test__ = {}\n__test__['t'] = P\n",
    ],
)
def test_doctest_text_made_at_run_time_is_a_finding(extra: bytes) -> None:
    found = added_findings(BASE, BASE + extra, "pkg/flip.py")
    assert "doctest-text" in {f.rule for f in found}, found


@pytest.mark.parametrize(
    "extra",
    [
        b'flip.__doc__ = "Flip."\n',
        b"flip.__doc__ = getattr(pow, '__doc__', None)\n",
        b'flip.__doc__ = pow.__doc__ + "\\n\\nFlipped."\n',
        b'NOTE = "Flipped."\nflip.__doc__ = "%s %s" % (pow.__doc__, NOTE)\n',
        b'flip.__doc__ += "\\n\\nFlipped."\n',
    ],
)
def test_docstring_text_copied_or_spliced_from_literals_is_no_finding(extra: bytes) -> None:
    assert added_findings(BASE, BASE + extra, "pkg/flip.py") == []


def test_a_doctest_in_a_text_file_is_scanned_as_code() -> None:
    text = b"Usage\n=====\n\n>>> import gc\n>>> gc.collect()\n0\n"
    assert [f.rule for f in added_findings(None, text, "README.rst")] == ["import"]
    assert added_findings(text, text, "README.rst") == []  # the base's own example


def test_doctests_that_cannot_run_or_are_ordinary_give_no_finding() -> None:
    # an ordinary new example; one that does not compile (doctest runs nothing for it); a
    # docstring doctest's parser refuses (no example of it runs); the base's own example moved
    assert added_findings(BASE, _with("    >>> flip(pow, 3, 2)\n    8\n"), "p.py") == []
    assert added_findings(BASE, _with("    >>> flip.__code__ = (\n"), "p.py") == []
    assert added_findings(BASE, _with("    >>>flip.__code__ = None\n"), "p.py") == []
    moved = _with(PATCH).replace(b"def flip", b"X = 1\n\n\ndef flip")
    assert added_findings(_with(PATCH), moved, "p.py") == []


def test_a_new_text_file_holding_a_doctest_prompt_is_no_byproduct(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("a line\n" * 200_000 + ">>> import gc\n")
    (tmp_path / "run.log").write_text("a line\n" * 200_000)
    assert not byproduct(tmp_path / "notes.txt", tmp_path / "absent")
    assert byproduct(tmp_path / "run.log", tmp_path / "absent")


@sandboxed
def test_a_docstring_example_beside_a_fix_is_denied(noconfig) -> None:
    """Graded end to end (the guard's child process): a fix whose docstring holds an example
    the rules deny gets no reward, the fix alone resolves (the test above)."""
    env, task = noconfig
    rel = task.extra["file"]
    old = (rollout_base(task, env) / rel).read_text().splitlines(keepends=True)
    at = next(i for i, ln in enumerate(old) if ln.startswith("    def itervalues(d, **kw):"))
    new = [*old[: at + 1], '        """>>> import gc; gc.collect()"""\n', *old[at + 1 :]]
    new[at + 2] = new[at + 2].replace("return None", "return iter(d.values(**kw))")
    result = grade(task, make_diff(rel, "".join(old), "".join(new)), env=env)
    assert result.denied and not result.resolved, result.reason
    assert any("import gc" in d for d in result.denied), result.denied
