"""Grading and training in the container backend (issue 43).

- parity: shipped tasks' gold patch and empty patch graded in the bwrap and the container backend
  give the same verdict, test by test (CI grades a seeded sample of ``CODERL_PARITY_TASKS`` tasks
  of parse, default 2; ``bench/container_parity.py`` runs whole task files);
- ``coderl train`` with ``sandbox.backend=container``: one GRPO step of tiny-random on a parse
  task, every rollout sandbox and every grade in a container.

Needs root, bubblewrap, podman and the Debian base image (``make sysdeps container-image``), and
the parse environment (built here from PyPI when missing, about a minute).
"""

from __future__ import annotations

import functools
import json
import os
import random
import shutil
from pathlib import Path

import pytest

from coderl.sandbox import Sandbox
from coderl.sandbox.base import BACKEND_ENV, BACKENDS
from coderl.sandbox.container import IMAGE_ENV, ContainerSandbox

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("podman") is None or shutil.which("bwrap") is None,
    reason="container grading needs root, bubblewrap and podman (make sysdeps)",
)
ROOT = Path(__file__).parent.parent
PARSE = "parse==1.22.4"
PARSE_TASKS = ROOT / "data" / "tasks" / "parse.jsonl.gz"
N_TASKS = int(os.environ.get("CODERL_PARITY_TASKS", "2"))


@pytest.fixture(scope="module")
def image() -> str:
    from coderl.sandbox.images import base_image

    return base_image()


@pytest.fixture(scope="module")
def parse_env():
    from coderl.envbuild.build import build_env

    return build_env(PARSE)


def _sample() -> list[str]:
    from coderl.tasks.spec import load_tasks

    tasks = load_tasks(PARSE_TASKS)
    return [t.id for t in random.Random(0).sample(tasks, min(N_TASKS, len(tasks)))]


@pytest.mark.parametrize("task_id", _sample())
def test_gold_and_empty_patch_grade_alike_in_both_backends(task_id, parse_env, image, monkeypatch):
    from coderl.grading.grade import grade
    from coderl.tasks.spec import load_tasks

    monkeypatch.setenv(IMAGE_ENV, image)
    task = next(t for t in load_tasks(PARSE_TASKS) if t.id == task_id)
    verdicts = {}
    for backend in ("bwrap", "container"):
        factory = functools.partial(Sandbox.create, backend=backend)
        for name, diff in (("gold", task.gold_patch), ("empty", "")):
            r = grade(task, diff, factory=factory)
            assert r.grading_error is None, (backend, name, r.grading_error)
            verdicts[backend, name] = (r.resolved, r.failure_kind, r.tests, r.tampered, r.denied)
    assert verdicts["container", "gold"][0] and not verdicts["container", "empty"][0]
    assert verdicts["container", "gold"] == verdicts["bwrap", "gold"]
    assert verdicts["container", "empty"] == verdicts["bwrap", "empty"]


def test_train_one_step_with_the_container_backend(tmp_path, parse_env, image, monkeypatch):
    from coderl.config import load_config
    from coderl.train.loop import train

    started: list[str] = []

    class Counted(ContainerSandbox):
        def __init__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            super().__init__(*args, **kwargs)
            started.append(self.image)

    monkeypatch.setitem(BACKENDS, "container", Counted)
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    cfg = load_config(
        ROOT / "configs" / "repo-bugfix.yaml",
        [
            "model.name=tiny-random",
            "model.lora=false",
            f"tasks.options.tasks_file={PARSE_TASKS}",
            "tasks.limit=1",
            "tasks.tasks_per_step=1",
            "rollout.group_size=2",
            "rollout.max_turns=1",
            "rollout.max_new_tokens=8",
            "rollout.concurrency=2",
            "trainer.steps=1",
            "trainer.checkpoint_every=1",
            "eval.before_after=false",
            "sft.enabled=false",
            "progress=false",
            "tensorboard=false",
            "sandbox.backend=container",
            f"sandbox.image={image}",
            f"run_dir={tmp_path / 'run'}",
        ],
    )
    run_dir = train(cfg)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 1
    # two rollout sandboxes and two grades (each at least one sandbox), all in containers
    assert len(started) >= 4 and set(started) == {image}
    assert BACKEND_ENV not in os.environ  # the run put the process's backend back

    # coderl eval of that checkpoint in containers, written as a SWE-bench harness run
    from coderl.cli import main

    before = len(started)
    harness = tmp_path / "harness"
    args = ["eval", str(run_dir), "tasks=repo:train", "k=1", "eval.tasks=1"]
    assert main([*args, "--harness", str(harness)]) == 0
    assert len(started) >= before + 3  # rollout, coderl's grade, the harness's run
    predictions = [json.loads(x) for x in (harness / "predictions.jsonl").read_text().splitlines()]
    assert len(predictions) == 1 and predictions[0]["model_name_or_path"] == "tiny-random"
    (summary,) = harness.glob("tiny-random.*.json")
    data = json.loads(summary.read_text())
    assert data["submitted_instances"] == 1 and data["schema_version"] == 2
    if predictions[0]["model_patch"]:  # a tiny random model's diff: resolved or not, reported
        (report,) = harness.glob("logs/run_evaluation/*/tiny-random/*/report.json")
        entry = json.loads(report.read_text())[predictions[0]["instance_id"]]
        assert entry["coderl"]["agree"] in (True, False) and "resolved" in entry
