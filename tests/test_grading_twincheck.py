"""The twin check (``coderl.grading.twincheck``): its record is read and honoured by the
second run's planting, a stale or malformed record is a clear error, and a task whose twin's
side effect fails the real test resolves its gold patch once checked (and not before)."""

from __future__ import annotations

import difflib
import json
import os
import random
import shutil
from pathlib import Path

import pytest

import coderl.grading.twincheck as twincheck
from coderl.envbuild.build import build_env
from coderl.grading.grade import grade
from coderl.grading.rerun import TwinPolicy, plant_canaries
from coderl.grading.twincheck import check_task, fingerprint, save, twin_policy
from coderl.grading.twins import RULES
from coderl.tasks.spec import Task

TEST_FILE = """\
import six

_calls = []


def test_once():
    _calls.append(1)
    assert len(_calls) == 1
    assert six.coderl_answer() == 3


def test_other():
    assert six.coderl_answer() + 1 == 4
"""
"""``test_once`` passes only as the first of its kind to run: its twin (its own body, the last
assertion changed) appends to ``_calls`` too, so a twin run before it fails it."""

F2P = ["test_state.py::test_once", "test_state.py::test_other"]


def _task(task_id: str = "tiny/twin-state", gold: str = "diff\n", bug: str = "") -> Task:
    return Task(
        id=task_id,
        kind="repo",
        env_id="six-1.17.0-653060730c4c",
        problem_statement="p",
        FAIL_TO_PASS=F2P,
        held_out_tests=[],
        bug_patch=bug,
        gold_patch=gold,
        source="pypi:six==1.17.0",
        license="MIT",
    )


def _record(path: Path, task: Task, untwinned: list[str], **top: object) -> Path:
    entry = {"fingerprint": fingerprint(task), "untwinned": untwinned, "gold": "resolved"}
    data = {"version": 1, "rules": RULES, "tasks": {task.id: entry}} | top
    path.write_text(json.dumps(data))
    return path


def test_a_recorded_test_gets_no_twin_and_the_others_still_do(tmp_path):
    src = tmp_path / "test_state.py"
    src.write_text(TEST_FILE)
    task = _task()
    record = _record(tmp_path / "twin_check.json", task, ["test_state.py::test_once"])
    policy = twin_policy(task, record)
    assert policy.untwinned == {"test_state.py::test_once"}
    for seed in range(5):
        out = tmp_path / f"out{seed}"
        out.mkdir()
        planted = plant_canaries(
            {"test_state.py": src}, F2P, random.Random(seed), out, (), twins=policy
        )
        assert planted.twinless == ["test_state.py::test_once"]
        assert set(planted.twins.values()) == {"test_state.py::test_other"}
        renamed = [k for k, v in planted.renamed.items() if v == F2P[0]]  # still renamed
        assert renamed and renamed[0] != F2P[0]
    # a task the record does not hold keeps every twin
    assert twin_policy(_task("tiny/other"), record) == TwinPolicy()
    out = tmp_path / "all"
    out.mkdir()
    planted = plant_canaries({"test_state.py": src}, F2P, random.Random(0), out, ())
    assert planted.twinless == [] and set(planted.twins.values()) == set(F2P)


def test_a_stale_or_malformed_record_is_a_clear_error(tmp_path):
    task = _task()
    path = tmp_path / "twin_check.json"
    _record(path, task, [])
    assert twin_policy(task, path) == TwinPolicy(frozenset())
    changed = _task(gold="diff\n+changed\n")
    with pytest.raises(
        ValueError, match=r"twin_check\.json: task tiny/twin-state is not the task this id's twins"
    ):
        twin_policy(changed, path)
    cases = {
        "{not json": "not a twin check record",
        json.dumps({"version": 1, "rules": RULES}): "no 'tasks' object",
        json.dumps({"version": 2, "rules": RULES, "tasks": {}}): "format version 2",
        json.dumps({"version": 1, "rules": RULES + 1, "tasks": {}}): "twin rules",
        json.dumps({"version": 1, "rules": RULES, "tasks": {"x": {"untwinned": []}}}): "task x",
    }
    for n, (text, why) in enumerate(cases.items()):
        bad = tmp_path / f"bad{n}.json"
        bad.write_text(text)
        with pytest.raises(ValueError, match=why) as info:
            twin_policy(task, bad)
        assert str(bad) in str(info.value) and "coderl tasks twin-check" in str(info.value)
    assert twin_policy(task, tmp_path / "none.json") == TwinPolicy()  # no record: every twin


def _diff(rel: str, old: str | None, new: str) -> str:
    """A ``git diff``-shaped patch taking ``rel`` from ``old`` (``None``: absent) to ``new``."""
    head = f"diff --git a/{rel} b/{rel}\n" + ("new file mode 100644\n" if old is None else "")
    body = difflib.unified_diff(
        (old or "").splitlines(keepends=True),
        new.splitlines(keepends=True),
        "/dev/null" if old is None else f"a/{rel}",
        f"b/{rel}",
    )
    return head + "".join(body)


needs_bwrap = pytest.mark.skipif(
    shutil.which("bwrap") is None or os.geteuid() != 0,
    reason="needs bubblewrap and root (make sysdeps); CI has both",
)


@needs_bwrap
def test_a_twin_that_breaks_its_test_is_dropped_and_the_gold_patch_resolves(tmp_path, monkeypatch):
    env = build_env("six==1.17.0")
    six = (Path(env.snapshot) / "six.py").read_text()
    buggy = six + "\n\ndef coderl_answer():\n    return 2\n"
    fixed = six + "\n\ndef coderl_answer():\n    return 3\n"
    bug = _diff("six.py", six, buggy) + _diff("test_state.py", None, TEST_FILE)
    task = _task(gold=_diff("six.py", buggy, fixed), bug=bug)
    monkeypatch.setattr(twincheck, "TWIN_CHECK", tmp_path / "twin_check.json")
    # before the check: a twin before test_once fails it in the second run only
    before = grade(task, task.gold_patch, env=env, twins=TwinPolicy(side="before"))
    assert (
        not before.resolved and "the two runs disagree: test_state.py::test_once" in before.reason
    )
    assert not grade(task, "", env=env).resolved  # a real task: unfixed, it fails
    entry = check_task(task, grade, env=env)
    assert entry["untwinned"] == ["test_state.py::test_once"] and entry["gold"] == "resolved"
    save({task.id: entry})
    for _ in range(2):  # grading reads the record: test_once has no twin, test_other keeps its
        after = grade(task, task.gold_patch, env=env)
        assert after.resolved and after.second_run, after.reason
        assert after.twinless == ["test_state.py::test_once"] and not after.twins_not_failed
    (tmp_path / "twin_check.json").write_text("{")  # a malformed record: masked, never scored
    bad = grade(task, task.gold_patch, env=env)
    assert bad.failure_kind == "infra" and "coderl tasks twin-check" in str(bad.grading_error)


def test_the_command_records_each_checked_task_and_fails_on_an_error(tmp_path, monkeypatch, capsys):
    import coderl.tasks.env as env_mod
    from coderl.cli import main
    from coderl.tasks.spec import dump_tasks

    tasks = [_task("tiny/a"), _task("tiny/b"), _task("tiny/c")]
    dump_tasks(tasks, tmp_path / "tasks.jsonl")

    def check(task, grader, env=None):
        if task.id == "tiny/b":
            raise RuntimeError("sandbox: gone")
        return {"fingerprint": fingerprint(task), "untwinned": F2P[:1], "gold": "resolved"}

    monkeypatch.setattr(twincheck, "check_task", check)
    monkeypatch.setattr(env_mod, "find_env", lambda env_id: None)
    out = tmp_path / "record.json"
    argv = ["tasks", "twin-check", str(tmp_path / "tasks.jsonl"), "--out", str(out)]
    assert main([*argv, "--ids", "tiny/a", "tiny/b"]) == 1  # an error: exit 1, the rest recorded
    assert "tiny/b: error: sandbox: gone" in capsys.readouterr().out
    assert set(twincheck.load(out)) == {"tiny/a"}
    assert twin_policy(tasks[0], out).untwinned == {F2P[0]}
    assert main([*argv, "--ids", "tiny/c"]) == 0 and set(twincheck.load(out)) == {
        "tiny/a",
        "tiny/c",
    }


def test_the_check_drops_what_it_blames_then_every_twin():
    from coderl.grading.verdict import GradeResult

    task = _task()
    seen: list[TwinPolicy] = []

    def grader(broken: str, blame: str):
        def run(task, diff, *, env, timeout, guard, twins):
            seen.append(twins)
            result = GradeResult(task.id, resolved=broken in twins.untwinned, second_run=True)
            if blame == "first run":  # a failure where no twin runs
                result.resolved, result.second_run = False, False
                result.reason = "1 of 2 tests did not pass"
            elif not result.resolved:
                result.reason = "the two runs disagree"
                if blame == "disagree":
                    result.rerun_disagreed = [f"{broken}: passed then failed"]
                elif blame == "twin":
                    result.twins_not_failed = [broken]
                else:  # a twin that ends the second run's process
                    result.reason = "second run: no valid verdict"
            return result

        return run

    for blame in ("disagree", "twin"):  # the test blamed loses its twins, no other
        seen.clear()
        entry = check_task(task, grader(F2P[1], blame))
        assert entry["untwinned"] == [F2P[1]] and entry["gold"] == "resolved"
        assert [p.side for p in seen] == ["before", "after"] * 2
    # nothing to blame (a twin that ends the second run's process): every twin goes
    entry = check_task(task, grader(F2P[1], "none"))
    assert entry["untwinned"] == F2P and entry["gold"] == "resolved"
    # a gold patch that fails without any twin is recorded so
    entry = check_task(task, grader("nothing", "none"))
    assert entry["untwinned"] == F2P and entry["gold"] == "second run: no valid verdict"
    # a failure of the first run (no twin there) drops nothing
    seen.clear()
    entry = check_task(task, grader(F2P[1], "first run"))
    assert entry["untwinned"] == [] and entry["gold"] == "1 of 2 tests did not pass"
    assert len(seen) == 2
