"""The pinned repositories, the split by repository, and the per-repository eval report."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from coderl.config import load_config
from coderl.tasks.repos import (
    REPOS_FILE,
    load_repo_tasks,
    per_repo_report,
    pinned,
    print_per_repo,
    read_repos,
    repo_of,
    round_robin,
    task_files,
)
from coderl.tasks.spec import Task, dump_tasks, load_tasks

SHIPPED = task_files()


def _task(repo: str, n: int, split: str = "train") -> Task:
    return Task(
        id=f"{repo}-1.0/{n:04d}",
        kind="repo",
        env_id=f"{repo}-1.0-abc",
        problem_statement="fix it",
        FAIL_TO_PASS=["tests/test_a.py::test_a"],
        PASS_TO_PASS=["tests/test_a.py::test_b"],
        held_out_tests=[],
        gold_patch="diff --git a/x b/x\n",
        source=f"pypi:{repo}==1.0",
        license="MIT",
        split=split,
    )


def test_repository_list_pins_at_least_ten_libraries_with_a_split_and_a_licence():
    pins = read_repos()
    assert len(pins) >= 10
    assert {p.split for p in pins} == {"train", "heldout"}
    assert all(p.license and p.license != "unknown" for p in pins)


def test_every_shipped_task_is_of_a_pinned_repository_and_carries_its_split_and_licence():
    pins = pinned()
    for path in SHIPPED:
        for task in load_tasks(path):
            pin = pins[repo_of(task)]
            assert task.source == f"pypi:{pin.spec}", task.id
            assert (task.split, task.license) == (pin.split, pin.license), task.id


def test_no_heldout_repository_task_is_in_the_training_split():
    heldout_repos = {p.name for p in read_repos() if p.split == "heldout"}
    train, heldout = load_repo_tasks("train"), load_repo_tasks("heldout")
    assert train and heldout
    assert {repo_of(t) for t in train}.isdisjoint(heldout_repos)
    assert {repo_of(t) for t in heldout} <= heldout_repos
    every = {t.id for path in SHIPPED for t in load_tasks(path)}
    assert {t.id for t in train} | {t.id for t in heldout} == every
    assert not {t.id for t in train} & {t.id for t in heldout}


def test_the_repo_source_loads_the_shipped_tasks_by_repository_split():
    from coderl.envs.registry import build_environment

    cfg = load_config(None, ["tasks.source=repo"])  # no tasks_file: the shipped files
    env = build_environment(cfg)
    train, heldout = env.tasks(cfg.tasks.train_split), env.tasks(cfg.tasks.heldout_split)
    assert [t.id for t in train] == [t.id for t in load_repo_tasks("train")]
    heldout_repos = {p.name for p in read_repos() if p.split == "heldout"}
    assert {repo_of(t) for t in heldout} == heldout_repos
    assert not {repo_of(t) for t in train} & heldout_repos
    with pytest.raises(ValueError, match="unknown split 'test'"):
        env.tasks("test")


def test_a_task_file_cannot_move_a_heldout_repository_into_training(tmp_path):
    repos = tmp_path / "repos.txt"
    repos.write_text("alpha==1.0 train MIT\nbeta==1.0 heldout BSD-3-Clause  # comment\n")
    tasks = tmp_path / "t.jsonl"
    # beta's tasks say "train" (synthesised elsewhere); gamma is not pinned: its field counts
    dump_tasks([_task("alpha", 1), _task("beta", 2, "train"), _task("gamma", 3, "heldout")], tasks)
    train = load_repo_tasks("train", tasks_file=str(tasks), repos_file=repos)
    heldout = load_repo_tasks("heldout", tasks_file=[str(tasks)], repos_file=repos)
    assert [t.id for t in train] == ["alpha-1.0/0001"]
    assert [t.id for t in heldout] == ["beta-1.0/0002", "gamma-1.0/0003"]


def test_repository_list_errors_name_the_line(tmp_path):
    bad = tmp_path / "repos.txt"
    for text, message in [
        ("a==1 train MIT\na==2 heldout MIT\n", "repos.txt:2: a is listed twice"),
        ("a==1 test MIT\n", "repos.txt:1: split 'test'"),
        ("a==1 train\n", "repos.txt:1: expected 'NAME==VERSION SPLIT LICENCE'"),
        ("./local train MIT\n", "repos.txt:1: expected"),
    ]:
        bad.write_text(text)
        with pytest.raises(ValueError, match=message):
            read_repos(bad)


def test_a_task_in_two_files_and_a_missing_file_are_errors(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    dump_tasks([_task("alpha", 1)], a)
    dump_tasks([_task("alpha", 1)], b)
    with pytest.raises(ValueError, match="is in both"):
        load_repo_tasks("train", tasks_file=str(tmp_path / "*.jsonl"), repos_file=REPOS_FILE)
    with pytest.raises(FileNotFoundError, match="no task file matches"):
        load_repo_tasks("train", tasks_file=str(tmp_path / "none.jsonl"))


def test_round_robin_puts_every_repository_in_the_first_tasks():
    tasks = [_task("b", i) for i in range(3)] + [_task("a", i) for i in range(2)]
    assert [t.id for t in round_robin(tasks)] == [
        "a-1.0/0000",
        "b-1.0/0000",
        "a-1.0/0001",
        "b-1.0/0001",
        "b-1.0/0002",
    ]
    shipped = load_repo_tasks("heldout")
    k = len({repo_of(t) for t in shipped})
    assert {repo_of(t) for t in shipped[:k]} == {repo_of(t) for t in shipped}


def test_per_repo_report_by_hand():
    tasks = [_task("a", 0), _task("a", 1), _task("b", 0)]
    per_task = [  # n = 4 samples per task
        {"task_id": "a-1.0/0000", "n": 4, "correct": 4, "best": 1.0, "f2p": 1.0},
        {"task_id": "a-1.0/0001", "n": 4, "correct": 0, "best": 0.5, "f2p": 0.25},
        {"task_id": "b-1.0/0000", "n": 4, "correct": 1, "best": 1.0, "f2p": 0.5},
    ]
    report = per_repo_report(per_task, tasks)
    assert list(report) == ["a", "b"]
    # a: resolved per task 4/4 and 0/4 -> mean 0.5; FAIL_TO_PASS 1.0 and 0.25 -> 0.625. With two
    # tasks a bootstrap resample is (1,1), (0,0) or a mix: the 95% CI spans the two values.
    assert report["a"]["tasks"] == 2
    assert report["a"]["resolved"] == {"mean": 0.5, "lo": 0.0, "hi": 1.0}
    assert report["a"]["fail_to_pass"] == {"mean": 0.625, "lo": 0.25, "hi": 1.0}
    # b: one task, 1 of 4 resolved: every resample is that task, so the CI is a point
    assert report["b"]["resolved"] == {"mean": 0.25, "lo": 0.25, "hi": 0.25}
    assert report["b"]["fail_to_pass"] == {"mean": 0.5, "lo": 0.5, "hi": 0.5}
    out = io.StringIO()
    print_per_repo(report, file=out)
    assert "0.625 [0.250, 1.000]" in out.getvalue() and "b" in out.getvalue()
    with pytest.raises(KeyError):
        per_repo_report([{**per_task[0], "task_id": "nope"}], tasks)


def test_evaluate_reports_the_fail_to_pass_fraction_per_task():
    from coderl.envs.base import GradeRecord
    from coderl.eval.passk import evaluate
    from coderl.policy.base import SamplingParams

    class Result:
        def __init__(self, f2p: float) -> None:
            self.fail_to_pass_passed = f2p

    class Env:
        def rollout(self, policy, tasks, params, samples):
            ep = {"broken_tool_calls": 0}
            return [type("E", (), {"task_id": t.id, **ep})() for t in tasks for _ in range(3)]

        def grade(self, tasks, episodes):
            grades = [GradeRecord(True, 1.0, result=Result(1.0))]
            grades.append(GradeRecord(False, 0.5, result=Result(0.5)))
            grades.append(GradeRecord(False, 0.0, grading_error="sandbox", result=Result(1.0)))
            return grades

    tasks = [_task("a", 0)]
    res = evaluate(Env(), None, tasks, samples=4, ks=[1], params=SamplingParams(seed=0))
    # 4 samples: 1.0 and 0.5 graded, one grading error (0), one missing episode (0) -> 1.5/4
    assert res.per_task[0]["f2p"] == pytest.approx(0.375)
    assert res.per_task[0]["correct"] == 1


def test_build_env_from_the_repository_list_reads_only_the_spec(tmp_path):
    import argparse

    from coderl.cli.tasks import _specs

    args = argparse.Namespace(spec=[], from_file=str(REPOS_FILE))
    specs = _specs(args)
    assert specs == [p.spec for p in read_repos()]
    assert all(Path(s).name == s and "==" in s for s in specs)


def test_coderl_eval_reports_per_repository_on_repo_tasks(tmp_path, monkeypatch, capsys):
    """The CLI path: a toy environment whose held-out tasks are repo tasks of two repositories;
    ``coderl eval`` adds ``per_repo`` (resolved rate = the per-task pass rates' mean; the
    FAIL_TO_PASS fraction from each grade's result) and prints the table on stderr."""
    import json
    from dataclasses import dataclass

    from coderl.cli import main
    from coderl.envs import ENVIRONMENTS, ToyEnvironment
    from coderl.envs.base import GradeRecord
    from coderl.envs.toy import ToyTask
    from coderl.train.loop import train

    @dataclass
    class RepoToyTask(ToyTask):
        kind: str = "repo"
        source: str = ""

    class Result:
        fail_to_pass_passed = 0.5

    class RepoToy(ToyEnvironment):
        def __post_init__(self) -> None:
            super().__post_init__()
            self._tasks["heldout"] = [
                RepoToyTask(f"r{i % 2}-1.0/{i}", t.prompt_ids, 0, source=f"pypi:r{i % 2}==1.0")
                for i, t in enumerate(self._tasks["heldout"])
            ]

        def grade(self, tasks, episodes):
            return [
                GradeRecord(g.resolved, g.fraction_passed, result=Result())
                for g in super().grade(tasks, episodes)
            ]

    monkeypatch.setitem(ENVIRONMENTS, "repotoy", lambda cfg: RepoToy(cfg.rollout.max_new_tokens))
    toy = Path(__file__).parent.parent / "configs" / "toy.yaml"
    run_dir = tmp_path / "run"
    overrides = ["tasks.source=repotoy", "trainer.steps=1", "trainer.checkpoint_every=1"]
    overrides += ["tensorboard=false", "progress=false", "eval.before_after=false"]
    train(load_config(toy, [*overrides, f"run_dir={run_dir}"]))
    assert main(["eval", str(run_dir), "k=4", "eval.tasks=6"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    per_repo = out["per_repo"]
    assert sorted(per_repo) == ["r0", "r1"] and [r["tasks"] for r in per_repo.values()] == [3, 3]
    assert all(r["fail_to_pass"] == {"mean": 0.5, "lo": 0.5, "hi": 0.5} for r in per_repo.values())
    overall = sum(r["resolved"]["mean"] * r["tasks"] for r in per_repo.values()) / 6
    assert overall == pytest.approx(out["pass_at"]["1"]["mean"])
    assert "per repository" in captured.err and "r1" in captured.err
