"""A user's first day (issue 48), sixth pass: ``policy_version`` counts weight updates (a step
that updated nothing keeps it, so async staleness is not inflated and resume restores it),
``coderl export`` / ``coderl eval`` take an online run's champion, and a refused ``coderl online
run`` leaves a new run directory as it found it."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

from coderl.asyncrl import AsyncConfig, AsyncRunner, cycle_tasks
from coderl.asyncrl.toy import ToyLearner, ToySampler, toy_tasks
from coderl.cli import main
from coderl.envs.base import GradeRecord
from coderl.envs.toy import ToyEnvironment
from coderl.metrics import read_jsonl
from coderl.train.checkpoint import list_checkpoints

ROOT = Path(__file__).parent.parent
TOY = str(ROOT / "configs" / "toy.yaml")
ONLINE = str(ROOT / "configs" / "online-demo.yaml")
FAST = [
    "progress=false",
    "tensorboard=false",
    "eval.before_after=false",
    "trainer.checkpoint_every=1",
    "trainer.keep_checkpoints=5",
    "rollout.group_size=4",
    "rollout.max_new_tokens=4",
]


pytestmark = pytest.mark.usefixtures("one_torch_thread_each")  # conftest: tests set threads


# --- policy_version counts updates, not steps --------------------------------------------------


def _grades_by_step(pattern: str):
    """A toy ``grade`` whose n-th call (one per training step) gives every group reward variance
    (``pattern[n] == "u"``: the step updates) or none (``"-"``: every group dropped, no update)."""
    calls = []

    def grade(self, tasks, episodes):
        varied = pattern[len(calls)] == "u"
        calls.append(1)
        return [
            GradeRecord(
                resolved=varied and i % 2 == 0, fraction_passed=float(varied and i % 2 == 0)
            )
            for i in range(len(episodes))
        ]

    return grade


def test_a_step_without_an_update_keeps_the_version_and_resume_restores_it(tmp_path, monkeypatch):
    run = tmp_path / "run"
    monkeypatch.setattr(ToyEnvironment, "grade", _grades_by_step("u-u"))
    argv = ["train", TOY, *FAST, "dynamic_sampling.mode=drop", "trainer.steps=2"]
    assert main([*argv, f"run_dir={run}", "--no-report"]) == 0
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["optimizer_steps"] > 0 for r in rows] == [True, False]
    assert [r["policy_version"] for r in rows] == [1.0, 1.0]  # step 2 changed no weight
    states = [json.loads((c / "state.json").read_text()) for c in list_checkpoints(run)]
    assert [(s["step"], s["version"]) for s in states] == [(1, 1), (2, 1)]
    resume = ["train", "--resume", str(run), "trainer.steps=3", "--no-report"]
    assert main(resume) == 0  # the third grade call: an update
    last = read_jsonl(run / "metrics.jsonl")[-1]
    assert (last["step"], last["policy_version"]) == (3, 2.0)


def test_the_async_learner_keeps_its_version_on_a_step_with_no_valid_episode(tmp_path):
    import coderl.asyncrl.trainer as T
    from coderl.asyncrl import EpisodeBuffer
    from coderl.asyncrl.types import Group, Job
    from coderl.config import load_config

    cfg = load_config(TOY, [*FAST, "trainer.micro_batch_size=8", f"run_dir={tmp_path}"])
    learner, sampler = T.TrainLearner(cfg), T.EnvSampler(cfg)
    sampler.load_weights(0, learner.weights())
    stream = T.task_stream(learner.run.env.tasks("train"), 0)
    jobs = [
        Job(i, task, task_id, seed=i + 1) for i, (task_id, task) in enumerate(map(stream, [0, 1]))
    ]
    empty, waiting = (Group(j, sampler.rollout(j, lambda: 0), version=0) for j in jobs)
    for seg in (s for ep in empty.episodes for s in ep.trajectory.segments):
        seg.loss_mask[:] = [0] * len(seg.loss_mask)  # graded, but no token to train on
    before = learner.weights()
    metrics = learner.train_step([empty])
    assert metrics["optimizer_steps"] == 0.0
    assert (learner.version, metrics["policy_version"]) == (0, 0.0)
    assert learner.steps == 1
    assert all(torch.equal(before[k], v) for k, v in learner.weights().items())
    # a group sampled before that step is as fresh after it: max_staleness=0 still admits it
    buffer = EpisodeBuffer(max_staleness=0)
    buffer.put(waiting)
    assert buffer.evict_stale(learner.version) == []
    assert buffer.take(1, learner.version) == [waiting]


class EveryOtherStepUpdates(ToyLearner):
    """The toy learner whose odd steps update nothing (as a step whose every episode is
    masked): one step, no new version."""

    def train_step(self, groups):
        if self.steps % 2 == 1:
            self.steps += 1
            return {"optimizer_steps": 0.0}
        return super().train_step(groups)


def test_the_async_runner_counts_steps_and_publishes_only_new_weights():
    K, V = 6, 6
    make = functools.partial(ToySampler, K, V, group_size=2)
    cfg = AsyncConfig(max_staleness=1, groups_per_step=1, num_workers=1)
    learner = EveryOtherStepUpdates(K, V)
    published = []
    with AsyncRunner(cfg, learner, make, cycle_tasks(toy_tasks(K, V))) as runner:
        runner.run(0)  # builds the backend
        real = runner.backend.publish
        runner.backend.publish = lambda v, w: published.append(v) or real(v, w)
        runner.run(8)
    assert (learner.steps, learner.version) == (8, 4)
    assert [h["version"] for h in runner.history] == [1, 1, 2, 2, 3, 3, 4, 4]
    assert published == [1, 2, 3, 4]  # a step that changed nothing sends no weights
    assert runner.summary()["dropped_groups"] == 0


# --- a refused `coderl online run` leaves a new run directory as it found it ---------------------


def _one_line_error(err: str) -> str:
    lines = [x for x in err.splitlines() if "error:" in x]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_online_run_refuses_a_port_another_server_holds_while_it_loads(
    tmp_path, capsys, monkeypatch
):
    import coderl.cli.online as online
    from coderl.cli.serve import listening_socket

    def loaded(*a, **k):
        raise AssertionError("the model loaded on a port another server holds")

    monkeypatch.setattr(online, "open_run", loaded)
    other = listening_socket("127.0.0.1", 0)  # what a server holds while its model loads
    try:
        port = other.getsockname()[1]
        run_dir = tmp_path / "online"
        argv = ["online", "run", ONLINE, "online.serve.host=127.0.0.1", f"online.serve.port={port}"]
        assert main([*argv, f"run_dir={run_dir}"]) == 2
        line = _one_line_error(capsys.readouterr().err)
        assert f"cannot listen on 127.0.0.1:{port}" in line, line
        assert not run_dir.exists()
    finally:
        other.close()


def test_an_online_run_refused_after_its_store_opened_leaves_the_directory_as_found(
    tmp_path, capsys, monkeypatch
):
    import coderl.cli.online as online

    def refused(*a, **k):
        raise ValueError("refused for the test after the store and registry opened")

    monkeypatch.setattr(online, "build_server", refused)
    fresh, kept = tmp_path / "fresh", tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine\n")
    for run_dir in (fresh, kept):
        argv = ["online", "run", ONLINE, "online.serve.port=0", f"run_dir={run_dir}"]
        assert main(argv) == 2
        assert "refused for the test" in _one_line_error(capsys.readouterr().err)
    assert not fresh.exists()
    assert sorted(p.name for p in kept.iterdir()) == ["notes.txt"]
    # `online report` of a directory with no cycle creates nothing either
    assert main(["online", "report", ONLINE, f"run_dir={fresh}"]) == 1
    assert not fresh.exists()


def test_a_failure_after_the_first_recorded_interaction_keeps_the_store(tmp_path):
    from coderl.config import load_online_config
    from coderl.online.cycle import open_run
    from coderl.online.runfiles import setup_only
    from coderl.online.store import interaction_row
    from coderl.rundir import online_lock

    run_dir = tmp_path / "online"
    cfg = load_online_config(ONLINE, [f"run_dir={run_dir}"])
    with pytest.raises(RuntimeError, match="after a result"):
        with online_lock(run_dir, "cycle", setup=setup_only):
            store, _ = open_run(cfg)
            store.record_interaction(
                interaction_row(
                    "i-1",
                    policy_version=0,
                    created_at=1.0,
                    prompt_token_ids=[1],
                    completion_token_ids=[2],
                    behaviour_logprobs=[-0.5],
                    temperature=0.8,
                )  # fmt: skip
            )
            raise RuntimeError("after a result")
    assert (run_dir / "online.db").is_file() and (run_dir / "registry" / "CHAMPION").is_file()


# --- coderl export / coderl eval take an online run's champion -----------------------------------


def _promote_a_candidate(run_dir: Path, *overrides: str):
    """What a cycle that promotes leaves: version 1 (the base with its trainable weights moved),
    promoted to shared champion. Returns its policy."""
    from coderl.config import load_online_config
    from coderl.online.cycle import load_version, open_run

    cfg = load_online_config(ONLINE, [f"run_dir={run_dir}", *overrides])
    _, registry = open_run(cfg)
    policy = load_version(cfg, registry, 0)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in policy.trainable_parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen))
    version = registry.new_version(parent=0, info={"base": cfg.model.name})
    policy.save(registry.version_dir(version))
    registry.promote(version, {"decision": "promote"})
    return policy


def test_export_and_eval_of_an_online_run_before_any_promotion_say_what_to_run(tmp_path, capsys):
    from coderl.config import load_online_config
    from coderl.online.cycle import open_run

    run_dir = tmp_path / "online"
    open_run(load_online_config(ONLINE, [f"run_dir={run_dir}"]))  # version 0: the base model
    for argv in (["export", str(run_dir)], ["eval", str(run_dir)]):
        assert main(argv) == 2, argv
        line = _one_line_error(capsys.readouterr().err)
        assert "no candidate has been promoted yet" in line and "coderl online run" in line, line
    assert main(["eval", str(run_dir), "--version", "0"]) == 2
    assert "--base` evaluates it" in _one_line_error(capsys.readouterr().err)
    assert main(["export", str(run_dir), "--version", "7"]) == 2
    assert "version 7 does not exist (known: [0])" in _one_line_error(capsys.readouterr().err)
    assert not (run_dir / "export").exists()


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_export_of_an_online_run_writes_its_champion(tmp_path, capsys, lora):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run_dir, out = tmp_path / "online", tmp_path / "out"
    champion = _promote_a_candidate(run_dir, f"model.lora={str(lora).lower()}")
    assert main(["export", str(run_dir), "--out", str(out)]) == 0
    assert "registry version 1 (champion)" in capsys.readouterr().err
    manifest = json.loads((out / "export.json").read_text())
    assert (manifest["registry_version"], manifest["status"]) == (1, "champion")
    assert manifest["checkpoint"] == str((run_dir / "registry" / "versions" / "1").resolve())
    if lora:
        base = AutoModelForCausalLM.from_pretrained(out / "base")
        model = PeftModel.from_pretrained(base, out / "adapter")
    else:
        model = AutoModelForCausalLM.from_pretrained(out)
    exported = dict(model.named_parameters())
    for name, p in champion.model.named_parameters():
        if p.requires_grad:  # the champion's trained weights, not the base's
            assert torch.equal(exported[name], p.detach()), name
    # a registry version by its path: the same version
    v1 = run_dir / "registry" / "versions" / "1"
    assert main(["export", str(v1), "--out", str(tmp_path / "v1")]) == 0
    assert json.loads((tmp_path / "v1" / "export.json").read_text())["registry_version"] == 1


def test_eval_of_an_online_run_evaluates_its_champion(tmp_path, capsys, monkeypatch):
    import coderl.train.run as R

    run_dir = tmp_path / "online"
    champion = _promote_a_candidate(run_dir)
    seen = []
    real = R.run_eval

    def spy(run, *a, **k):
        seen.append({n: p.detach().clone() for n, p in run.policy.model.named_parameters()})
        return real(run, *a, **k)

    monkeypatch.setattr(R, "run_eval", spy)
    argv = ["eval", str(run_dir), "eval.tasks=1", "k=1", "progress=false"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["registry_version"] == 1 and out["checkpoint"].endswith("registry/versions/1")
    [weights] = seen
    assert all(torch.equal(weights[n], p.detach()) for n, p in champion.model.named_parameters())
