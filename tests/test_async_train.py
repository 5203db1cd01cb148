"""The async loop on the real trainer step and environment (tiny random model, toy task):
max_staleness=0 equals the synchronous reference loop bit for bit, and ``train_async`` logs,
checkpoints (with the task ledger) and resumes."""

from __future__ import annotations

import json

import pytest
import torch

from coderl.asyncrl import AsyncConfig, AsyncRunner, run_sync
from coderl.asyncrl.trainer import (
    TrainLearner,
    _SamplerFactory,
    load_configs,
    task_stream,
    train_async,
)

OVERRIDES = [
    "rollout.group_size=4",
    "trainer.micro_batch_size=8",
    "tensorboard=false",
    "progress=false",
    "eval.before_after=false",
]


@pytest.fixture(autouse=True)
def one_torch_thread():
    # tiny models gain nothing from intra-op threads, and on busy shared cores they spin
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_max_staleness_zero_on_the_real_trainer_equals_the_sync_loop(tmp_path):
    cfg, _ = load_configs("configs/toy.yaml", [*OVERRIDES, f"run_dir={tmp_path}"])
    sync = TrainLearner(cfg)
    tasks = task_stream(sync.run.env.tasks("train"), cfg.seed)
    history, trained = run_sync(sync, _SamplerFactory(cfg), tasks, num_steps=2, groups_per_step=2)
    learner = TrainLearner(cfg)
    acfg = AsyncConfig(max_staleness=0, groups_per_step=2, num_workers=2)
    with AsyncRunner(acfg, learner, _SamplerFactory(cfg), tasks) as runner:
        runner.run(2)
    assert runner.trained_tasks == trained == [0, 1, 2, 3]
    a, b = sync.weights(), learner.weights()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [h["loss"] for h in runner.history] == [h["loss"] for h in history]
    # on-policy: the trainer recomputes exactly the sampler's logprobs (up to float rounding)
    assert all(h["logprob_gap"] < 1e-4 for h in runner.history)


def test_train_async_logs_checkpoints_and_resumes(tmp_path):
    over = [
        *OVERRIDES,
        f"run_dir={tmp_path}",
        "trainer.steps=3",
        "trainer.checkpoint_every=2",
        "async.max_staleness=1",
        "async.groups_per_step=2",
        "async.num_workers=2",
    ]
    cfg, acfg = load_configs("configs/toy.yaml", over)
    summary = train_async(cfg, acfg)
    assert summary["steps"] == 3 and max(summary["staleness_hist"]) <= 1
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3]
    assert all(x["staleness_max"] <= 1 and "async/trainer_idle_fraction" in x for x in lines)
    state = json.loads((tmp_path / "checkpoints" / "step-000003" / "state.json").read_text())
    assert state["version"] == 3 and state["ledger"]["next_index"] >= 6
    outstanding = len(state["ledger"]["retry"])  # groups in flight at the checkpoint
    assert outstanding == state["ledger"]["next_index"] - 6  # 6 trained, none dropped here

    cfg2, acfg2 = load_configs("configs/toy.yaml", [*over, "trainer.steps=4"])  # last one wins
    summary2 = train_async(cfg2, acfg2, resume=True)
    assert summary2["steps"] == 1  # resumed at step 3, trained step 4 only
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3, 4]


def test_async_section_in_yaml_and_overrides(tmp_path):
    preset = tmp_path / "a.yaml"
    preset.write_text("model: {name: tiny-random}\nasync: {max_staleness: 3, num_workers: 1}\n")
    cfg, acfg = load_configs(str(preset), ["async.stale_policy=resample", "seed=5"])
    assert (acfg.max_staleness, acfg.num_workers, acfg.stale_policy) == (3, 1, "resample")
    assert cfg.seed == 5
    with pytest.raises(ValueError, match="unknown async keys \\['workers'\\]"):
        load_configs(str(preset), ["async.workers=2"])


def test_cli_registers_train_async():
    from coderl.cli import build_parser

    args = build_parser().parse_args(["train-async", "c.yaml", "async.max_staleness=1", "--resume"])
    assert (args.config, args.overrides, args.resume) == ("c.yaml", ["async.max_staleness=1"], True)
