"""SWE-bench-format instances in and out: parsing, errors with file/line/field, round trips, and
grading the same before and after on an environment built from a local snapshot."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from coderl.envbuild.build import build_env
from coderl.grading.grade import grade
from coderl.tasks.env import EnvRecord
from coderl.tasks.patches import make_diff
from coderl.tasks.repos import repo_of
from coderl.tasks.spec import TaskFileError, load_tasks
from coderl.tasks.swebench import (
    check_test_patch,
    export_swebench,
    from_instance,
    import_swebench,
    read_image_tasks,
    task_instance,
    to_instance,
)

CI_TASKS = Path(__file__).parent.parent / "data" / "tasks" / "ci.jsonl"
BUGGY = "def add(a, b):\n    return a - b\n\n\ndef sub(a, b):\n    return a - b\n"
FIXED = BUGGY.replace("return a - b", "return a + b", 1)
TESTS = (
    "from mini.calc import add, sub\n\n\ndef test_add():\n    assert add(2, 3) == 5\n\n\n"
    "def test_sub():\n    assert sub(5, 3) == 2\n"
)


def make_repo(root: Path) -> Path:
    (root / "mini").mkdir(parents=True)
    (root / "mini" / "__init__.py").write_text("")
    (root / "mini" / "calc.py").write_text(BUGGY)
    (root / "tests").mkdir()
    (root / "tests" / "test_calc.py").write_text(TESTS)
    return root


def fake_env(snapshot: Path, env_id: str = "mini-local-000000000000") -> EnvRecord:
    return EnvRecord(
        env_id=env_id,
        spec=str(snapshot),
        name="mini",
        version="local",
        snapshot_digest="d" * 64,
        snapshot=str(snapshot),
        venv="/nonexistent",
        install_plan="test-imports",
        install_commands=[],
        test_paths=["tests"],
        test_command="pytest tests",
        passing=["tests/test_calc.py::test_sub"],
    )


def instance(**override) -> dict:
    inst = {
        "instance_id": "mini__mini-1",
        "repo": "mini/mini",
        "base_commit": "snapshot:" + "d" * 64,
        "patch": make_diff("mini/calc.py", BUGGY, FIXED),
        "test_patch": "",
        "problem_statement": "add() subtracts.",
        "hints_text": "",
        "created_at": "2024-01-01T00:00:00Z",
        "version": "0.1",
        "environment_setup_commit": "abc123",
        "FAIL_TO_PASS": json.dumps(["tests/test_calc.py::test_add"]),
        "PASS_TO_PASS": json.dumps(["tests/test_calc.py::test_sub"]),
    }
    inst.update(override)
    return inst


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_instance_fields_map_onto_the_task_spec(tmp_path):
    env = fake_env(make_repo(tmp_path / "repo"))
    task = from_instance(instance(extra_field=[1, 2]), env=env)
    assert task.id == "mini__mini-1" and task.kind == "repo" and task.env_id == env.env_id
    assert task.FAIL_TO_PASS == ["tests/test_calc.py::test_add"]
    assert task.PASS_TO_PASS == ["tests/test_calc.py::test_sub"]
    assert task.gold_patch.startswith("diff --git a/mini/calc.py") and task.bug_patch == ""
    assert task.source == "swebench:mini/mini@snapshot:" + "d" * 64
    sw = task.extra["swebench"]
    assert sw["environment_setup_commit"] == "abc123" and sw["extra_field"] == [1, 2]
    # plain lists are read too (SWE-Gym and some SWE-smith dumps)
    listed = from_instance(instance(FAIL_TO_PASS=["a::b"], PASS_TO_PASS=[]), env=env)
    assert listed.FAIL_TO_PASS == ["a::b"] and listed.PASS_TO_PASS == []


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ({"patch": ""}, "patch"),
        ({"FAIL_TO_PASS": "[not json"}, "FAIL_TO_PASS"),
        ({"FAIL_TO_PASS": "[]"}, "FAIL_TO_PASS"),
        ({"PASS_TO_PASS": json.dumps([1])}, "PASS_TO_PASS.0"),
        ({"coderl": {"split": "test"}}, "coderl.split"),
    ],
)
def test_malformed_instances_name_file_line_and_field(tmp_path, override, field):
    env = fake_env(make_repo(tmp_path / "repo"))
    path = write_jsonl(tmp_path / "in.jsonl", [instance(), instance(instance_id="x", **override)])
    if field == "coderl.split":  # the extension carries the env: no --env needed
        override["coderl"]["env_id"] = env.env_id
        write_jsonl(path, [instance(), instance(instance_id="x", **override)])
    with pytest.raises(TaskFileError) as err:
        import_swebench(path, env=env)
    assert (err.value.path, err.value.line, err.value.field) == (str(path), 2, field)
    assert f"{path}:2: field {field!r}" in str(err.value)


def test_missing_fields_env_and_json_array_lines(tmp_path):
    raw = instance()
    del raw["instance_id"]
    path = tmp_path / "in.json"
    path.write_text("[\n" + json.dumps(instance()) + ",\n\n" + json.dumps(raw) + "\n]\n")
    env = fake_env(make_repo(tmp_path / "repo"))
    with pytest.raises(TaskFileError) as err:
        import_swebench(path, env=env)
    assert (err.value.line, err.value.field) == (4, "instance_id")
    # no environment given and none built with that snapshot digest: say so, by field
    write_jsonl(path, [instance()])
    with pytest.raises(TaskFileError, match="no built environment") as err:
        import_swebench(path, cache=tmp_path / "empty-cache")
    assert err.value.field == "env_id"
    write_jsonl(path, [instance(), instance()])
    with pytest.raises(TaskFileError, match="duplicate instance_id") as err:
        import_swebench(path, env=env)
    assert err.value.line == 2


def test_test_patch_must_already_be_in_the_snapshot(tmp_path):
    snap = make_repo(tmp_path / "repo")
    new_tests = TESTS + "\n\ndef test_add_zero():\n    assert add(0, 0) == 0\n"
    patch = make_diff("tests/test_calc.py", TESTS, new_tests)
    assert check_test_patch(patch, snap) != ""  # git's complaint
    env = fake_env(snap)
    with pytest.raises(TaskFileError) as err:
        from_instance(instance(test_patch=patch), env=env)
    assert err.value.field == "test_patch"
    (snap / "tests" / "test_calc.py").write_text(new_tests)  # environment built with it
    assert check_test_patch(patch, snap) == ""
    task = from_instance(instance(test_patch=patch), env=env)
    assert task.extra["swebench"]["test_patch"] == patch


def test_round_trip_of_shipped_tasks_and_of_foreign_instances(tmp_path):
    shipped = load_tasks(CI_TASKS)
    out = tmp_path / "ci-swebench.jsonl.gz"
    assert export_swebench(shipped, out, cache=tmp_path / "cache") == len(shipped)
    again = import_swebench(out)  # the coderl extension carries env_id and bug_patch
    assert again == shipped
    first = json.loads(json.dumps(to_instance(shipped[0])))
    assert json.loads(first["FAIL_TO_PASS"]) == shipped[0].FAIL_TO_PASS  # JSON-encoded
    assert first["patch"] == shipped[0].gold_patch
    assert first["coderl"]["bug_patch"] == shipped[0].bug_patch

    env = fake_env(make_repo(tmp_path / "repo"))
    foreign = write_jsonl(tmp_path / "foreign.jsonl", [instance(hints_text="see #1")])
    tasks = import_swebench(foreign, env=env)
    export_swebench(tasks, tmp_path / "out.json")
    exported = json.loads((tmp_path / "out.json").read_text())
    original = instance(hints_text="see #1")
    assert {k: exported[0][k] for k in original} == original  # the SWE-bench fields survive
    assert import_swebench(tmp_path / "out.json") == tasks


def test_function_tasks_have_no_swebench_form():
    from coderl.tasks.humaneval import humaneval_tasks

    with pytest.raises(ValueError, match="only repo tasks"):
        to_instance(humaneval_tasks("train")[0])


needs_sandbox = pytest.mark.skipif(
    shutil.which("bwrap") is None or os.geteuid() != 0,
    reason="needs bubblewrap and root (make sysdeps); CI has both",
)


@needs_sandbox
def test_instances_from_a_local_snapshot_grade_the_same_after_a_round_trip(tmp_path):
    """A SWE-bench instance whose base is a local snapshot with a real bug: imported (the env
    found by its snapshot digest), graded, exported, re-imported, graded again."""
    cache = tmp_path / "cache"
    env = build_env(str(make_repo(tmp_path / "repo")), cache=cache)
    assert env.passing == ["tests/test_calc.py::test_sub"]
    assert env.failing == ["tests/test_calc.py::test_add"]
    inst = instance(base_commit="snapshot:" + env.snapshot_digest)
    tasks = import_swebench(write_jsonl(tmp_path / "in.jsonl", [inst]), cache=cache)
    assert tasks[0].env_id == env.env_id
    export_swebench(tasks, tmp_path / "out.jsonl", cache=cache)
    again = import_swebench(tmp_path / "out.jsonl", cache=cache)
    assert again == tasks
    exported = json.loads((tmp_path / "out.jsonl").read_text())
    assert exported["base_commit"] == inst["base_commit"]

    def verdicts(task):
        return [
            (r.resolved, r.fail_to_pass_passed, r.tests, r.grading_error)
            for r in (grade(task, diff, env=env) for diff in (task.gold_patch, ""))
        ]

    before, after = verdicts(tasks[0]), verdicts(again[0])
    assert before == after
    (gold_resolved, *_), (empty_resolved, f2p, tests, error) = before
    assert gold_resolved and not empty_resolved and error is None
    assert f2p == 0.0 and tests["tests/test_calc.py::test_sub"] == "passed"


def test_cli_export_then_import_gives_back_the_same_task_file(tmp_path, capsys):
    from coderl.cli import main

    out = tmp_path / "ci.json"
    assert main(["tasks", "export", str(CI_TASKS), "--format", "swebench", "--out", str(out)]) == 0
    assert isinstance(json.loads(out.read_text()), list)
    back = tmp_path / "ci.jsonl"
    assert main(["tasks", "import", str(out), "--out", str(back)]) == 0
    assert back.read_bytes() == CI_TASKS.read_bytes()
    capsys.readouterr()
    assert main(["tasks", "import", str(out), "--format", "r2e", "--out", str(back)]) == 2
    assert "unknown format 'r2e'; valid: ['swebench']" in capsys.readouterr().err
    assert back.read_bytes() == CI_TASKS.read_bytes()  # the failed import wrote nothing


def test_instances_with_their_own_image_read_as_image_tasks(tmp_path):
    """No coderl environment is looked up: the env id names the image (the instance's field, or
    SWE-bench's scheme), every other field travels in ``extra`` and comes back whole."""
    smith = instance(instance_id="a__b-2", image_name="jyangballin/swesmith.x:1", eval_script="x")
    path = write_jsonl(tmp_path / "in.jsonl", [instance(), smith])
    plain, own = read_image_tasks(path, split="heldout")
    assert plain.env_id == "image:swebench/sweb.eval.x86_64.mini_1776_mini-1:latest"
    assert own.env_id == "image:jyangballin/swesmith.x:1" and own.split == "heldout"
    assert own.held_out_tests == [] and own.FAIL_TO_PASS == ["tests/test_calc.py::test_add"]
    assert repo_of(own) == "mini/mini"  # per-repository reports group by the instance's repo
    (gym,) = read_image_tasks(write_jsonl(tmp_path / "gym.jsonl", [instance()]), namespace="gym")
    assert gym.env_id == "image:gym/sweb.eval.x86_64.mini_1776_mini-1:latest"
    assert task_instance(gym)["image"] == "gym/sweb.eval.x86_64.mini_1776_mini-1:latest"
    back = task_instance(own)
    assert back["eval_script"] == "x" and back["patch"] == smith["patch"]
    assert back["FAIL_TO_PASS"] == ["tests/test_calc.py::test_add"]
    with pytest.raises(ValueError, match="not an image task"):
        task_instance(from_instance(instance(), env=fake_env(tmp_path)))
    write_jsonl(path, [instance(), instance(FAIL_TO_PASS="[")])
    with pytest.raises(TaskFileError, match=r"in.jsonl:2: field 'FAIL_TO_PASS'"):
        read_image_tasks(path)
    write_jsonl(path, [instance(), instance()])
    with pytest.raises(TaskFileError, match=r"in.jsonl:2: field 'instance_id': duplicate"):
        read_image_tasks(path)
