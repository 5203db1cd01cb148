"""``coderl train`` and ``coderl eval`` on SWE-bench-format instances that bring their own image
(issue 43: "an instance with its own image trained one step"): ``tasks.source=swebench`` reads the
instance file, every episode runs in a container of the instance's image over its ``/testbed``,
every grade runs the instance's eval script in a fresh container of it, and ``coderl eval
--harness`` writes the SWE-bench predictions/report pair.

The image is built here (``tests/instance_image.py``). Needs root and podman (make sysdeps).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from coderl.config import ConfigError
from coderl.sandbox.base import BACKEND_ENV, BACKENDS
from coderl.sandbox.container import ContainerSandbox
from tests.instance_image import calc_instance

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("podman") is None,
    reason="instance images need root and podman (make sysdeps)",
)
ROOT = Path(__file__).parent.parent


def _overrides(instances: Path, run_dir: Path, backend: str = "container") -> list[str]:
    return [
        "model.name=tiny-random",
        "model.lora=false",
        "tasks.source=swebench",
        f"tasks.options.tasks_file={instances}",
        "tasks.tasks_per_step=1",
        "rollout.group_size=2",
        "rollout.max_turns=1",
        "rollout.max_new_tokens=8",
        "rollout.concurrency=2",
        "trainer.steps=1",
        "trainer.checkpoint_every=1",
        "eval.before_after=false",
        "sft.enabled=false",
        "dynamic_sampling.mode=off",  # a random model's group may tie: still one update
        "progress=false",
        "tensorboard=false",
        f"sandbox.backend={backend}",
        f"run_dir={run_dir}",
    ]


def test_train_and_eval_one_step_on_an_instance_with_its_own_image(tmp_path, monkeypatch):
    from coderl.cli import main
    from coderl.config import load_config
    from coderl.train.loop import train

    instance = calc_instance(tmp_path / "ctx")
    instances = tmp_path / "instances.jsonl"
    instances.write_text(json.dumps(instance) + "\n")
    started: list[tuple[str, str]] = []

    class Counted(ContainerSandbox):
        def __init__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            super().__init__(*args, **kwargs)
            started.append((self.image, str(self.base)))

    monkeypatch.setitem(BACKENDS, "container", Counted)
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    config = ROOT / "configs" / "repo-bugfix.yaml"
    cfg = load_config(config, _overrides(instances, tmp_path / "run"))
    run_dir = train(cfg)
    (line,) = (run_dir / "metrics.jsonl").read_text().splitlines()
    metrics = json.loads(line)
    assert metrics["episodes"] == 2 and metrics["reward/masked"] == 0  # both graded, none masked
    assert metrics["optimizer_steps"] == 1
    # two rollout sandboxes and two grades, every one a container of the instance's image; the
    # rollouts over the image's own /testbed (copied out), the grades over a patched copy of it
    assert len(started) == 4 and {image for image, _ in started} == {instance["image"]}
    assert len({base for _, base in started}) == 3
    assert BACKEND_ENV not in os.environ

    harness = tmp_path / "harness"
    args = ["eval", str(run_dir), "tasks=swebench:train", "k=1", "eval.tasks=1"]
    assert main([*args, "--harness", str(harness)]) == 0
    assert {image for image, _ in started} == {instance["image"]}
    (prediction,) = [
        json.loads(x) for x in (harness / "predictions.jsonl").read_text().splitlines()
    ]
    assert prediction["instance_id"] == "local__calc-1"
    assert prediction["model_name_or_path"] == "tiny-random"
    (report,) = harness.glob("logs/run_evaluation/*/tiny-random/local__calc-1/report.json")
    entry = json.loads(report.read_text())["local__calc-1"]
    assert entry["coderl"]["agree"] is True and entry["resolved"] is False  # a random model
    (summary,) = harness.glob("tiny-random.*.json")
    data = json.loads(summary.read_text())
    assert data["submitted_instances"] == 1 and data["resolved_instances"] == 0


def test_the_swebench_source_needs_the_container_backend_and_no_sft(tmp_path):
    from coderl.config import load_config
    from coderl.envs.registry import build_environment

    instances = tmp_path / "instances.jsonl"
    instances.write_text("")
    config = ROOT / "configs" / "repo-bugfix.yaml"
    cfg = load_config(config, _overrides(instances, tmp_path / "r", "bwrap"))
    with pytest.raises(ConfigError, match="sandbox.backend=container"):
        build_environment(cfg)
    cfg = load_config(config, [*_overrides(instances, tmp_path / "r"), "sft.enabled=true"])
    with pytest.raises(ConfigError, match="set sft.enabled=false"):
        build_environment(cfg)


def test_train_async_with_the_container_backend(tmp_path, monkeypatch):
    """``coderl train-async`` (rollout workers as threads, staleness bound 1) two steps on the
    instance: every rollout and grade in a container of its image."""
    from coderl.asyncrl.trainer import load_configs, train_async

    instance = calc_instance(tmp_path / "ctx")
    instances = tmp_path / "instances.jsonl"
    instances.write_text(json.dumps(instance) + "\n")
    images: list[str] = []

    class Counted(ContainerSandbox):
        def __init__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            super().__init__(*args, **kwargs)
            images.append(self.image)

    monkeypatch.setitem(BACKENDS, "container", Counted)
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    over = [
        *_overrides(instances, tmp_path / "run"),
        "trainer.steps=2",
        "async.max_staleness=1",
        "async.groups_per_step=1",
        "async.tasks_per_rollout=1",
        "async.num_workers=1",
    ]
    cfg, acfg = load_configs(str(ROOT / "configs" / "repo-bugfix.yaml"), over)
    summary = train_async(cfg, acfg)
    assert summary["steps"] == 2
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2]
    assert all(x["reward/masked"] == 0 and x["optimizer_steps"] == 1 for x in lines)
    # at least 2 steps x 2 episodes, each a rollout and a grade (a worker may run ahead)
    assert len(images) >= 8 and set(images) == {instance["image"]}
    assert BACKEND_ENV not in os.environ
