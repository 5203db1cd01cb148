"""The async driver on the real trainer step and environment (tiny random model, toy task):
max_staleness=0 reproduces ``coderl train`` (tasks, samples, weights), a harness that crashes on
some episodes has them masked out of the loss, and ``train_async`` logs, checkpoints (with the
task ledger) and resumes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from coderl.asyncrl.trainer import load_configs, train_async
from coderl.config import ConfigError, load_config
from coderl.envs import ENVIRONMENTS, EpisodeRecord, ToyEnvironment
from coderl.metrics import read_jsonl
from coderl.train.loop import train

TOY = Path(__file__).parent.parent / "configs" / "toy.yaml"
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


class RecordingToy(ToyEnvironment):
    """The toy task, logging every rollout (task ids, seed, sampled tokens) to ``log``; with
    ``crash_every=k`` every k-th episode ends as a harness crash (``finish_reason="error"``)
    that the grader would score as a perfect solve if the pipeline did not mask it."""

    log: list = []
    crash_every: int = 0

    def rollout(self, policy, tasks, params, group_size):
        episodes = super().rollout(policy, tasks, params, group_size)
        for i, ep in enumerate(episodes):
            if self.crash_every and i % self.crash_every == 0:
                ep.finish_reason = "error"
        RecordingToy.log.append(
            (
                [t.id for t in tasks],
                params.seed,
                [list(ep.trajectory.segments[0].token_ids) for ep in episodes],
            )
        )
        return episodes

    def grade(self, tasks, episodes: list[EpisodeRecord]):
        grades = super().grade(tasks, episodes)
        for g, ep in zip(grades, episodes, strict=True):
            if ep.finish_reason == "error":
                g.resolved, g.fraction_passed = True, 1.0  # what must never be trained on
        return grades


@pytest.fixture
def recorded(monkeypatch):
    RecordingToy.log, RecordingToy.crash_every = [], 0
    monkeypatch.setitem(
        ENVIRONMENTS, "recorded", lambda cfg: RecordingToy(cfg.rollout.max_new_tokens)
    )
    return RecordingToy


def _weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "checkpoints" / f"step-{step:06d}" / "trainable.safetensors"))


def test_max_staleness_zero_reproduces_coderl_train(tmp_path, recorded):
    common = [*OVERRIDES, "tasks.source=recorded", "trainer.steps=3", "trainer.checkpoint_every=3"]
    train(load_config(TOY, [*common, f"run_dir={tmp_path / 'sync'}"]))
    sync_log, recorded.log = recorded.log, []
    cfg = load_config(
        TOY,
        [*common, f"run_dir={tmp_path / 'async'}", "async.max_staleness=0", "async.num_workers=2"],
    )
    summary = train_async(cfg)
    assert summary["steps"] == 3 and summary["staleness_hist"] == {0: 6}
    # the same rollouts: tasks in the same order, the same seeds, the same sampled tokens (the
    # async run may have issued step 4's rollout before it stopped)
    assert len(sync_log) == 3 and recorded.log[:3] == sync_log
    a, b = _weights(tmp_path / "sync", 3), _weights(tmp_path / "async", 3)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    sa, sb = (
        json.loads((tmp_path / d / "checkpoints" / "step-000003" / "state.json").read_text())
        for d in ("sync", "async")
    )
    assert (sa["cursor"], sa["version"]) == (sb["cursor"], sb["version"]) == (6, 3)
    ma, mb = (
        read_jsonl(tmp_path / "sync" / "metrics.jsonl"),
        read_jsonl(tmp_path / "async" / "metrics.jsonl"),
    )
    for key in ("loss", "reward/mean", "advantage/std", "infra_failed_rate", "logprob_gap"):
        assert [m[key] for m in ma] == [m[key] for m in mb], key


@pytest.mark.parametrize("driver", ["train", "train-async"])
def test_episodes_of_a_crashing_harness_are_masked_out_of_the_loss(
    tmp_path, recorded, monkeypatch, driver
):
    # every 3rd episode "crashes" and would be graded a perfect solve: the batch that reaches the
    # trainer step must hold exactly the other episodes, and the step counts the crashes as infra
    recorded.crash_every = 3
    seen: list = []
    import coderl.train.run as module  # both drivers update through run.optimize

    real = module.train_step

    def spy(model, opt, sched, batch, *a, **kw):
        ids, mask = batch.tokens.input_ids, batch.tokens.attention_mask.bool()
        seen.append([tuple(r[m].tolist()) for r, m in zip(ids, mask, strict=True)])
        return real(model, opt, sched, batch, *a, **kw)

    monkeypatch.setattr(module, "train_step", spy)
    over = [*OVERRIDES, "tasks.source=recorded", "trainer.steps=2", f"run_dir={tmp_path}"]
    if driver == "train":
        train(load_config(TOY, over))
    else:
        train_async(load_config(TOY, [*over, "async.max_staleness=1", "async.num_workers=2"]))
    crashed = {tuple(e) for _, _, eps in recorded.log for i, e in enumerate(eps) if i % 3 == 0}
    fine = {tuple(e) for _, _, eps in recorded.log for i, e in enumerate(eps) if i % 3 != 0}
    assert len(seen) == 2
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    for rows, m in zip(seen, metrics, strict=True):
        assert len(rows) == 8 - 3  # 2 tasks x G=4: episodes 0, 3 and 6 crashed
        assert set(rows) <= fine and not set(rows) & crashed
        assert m["infra_failed_rate"] == pytest.approx(3 / 8)
        assert m["masked_rate"] == pytest.approx(3 / 8) and m["alarm/masked"] == 1.0
        assert m["agent_failed_rate"] == 0.0 and m["reward/masked"] == 3
        assert m["resolved_rate"] < 1.0  # the crashed "solves" are not counted either


def test_train_async_logs_checkpoints_and_resumes(tmp_path):
    over = [
        *OVERRIDES,
        f"run_dir={tmp_path}",
        "trainer.steps=3",
        "trainer.checkpoint_every=2",
        "async.max_staleness=1",
        "async.groups_per_step=2",
        "async.tasks_per_rollout=1",
        "async.num_workers=2",
    ]
    cfg, acfg = load_configs(str(TOY), over)
    summary = train_async(cfg, acfg)
    assert summary["steps"] == 3 and max(summary["staleness_hist"]) <= 1
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3]
    assert all(x["staleness_max"] <= 1 and "async/trainer_idle_fraction" in x for x in lines)
    assert all("infra_failed_rate" in x and "agent_failed_rate" in x for x in lines)
    state = json.loads((tmp_path / "checkpoints" / "step-000003" / "state.json").read_text())
    assert state["version"] == 3 and state["ledger"]["next_index"] >= 6
    outstanding = len(state["ledger"]["retry"])  # groups in flight at the checkpoint
    assert outstanding == state["ledger"]["next_index"] - 6  # 6 trained, none dropped here
    assert state["cursor"] == 6

    cfg2, acfg2 = load_configs(str(TOY), [*over, "trainer.steps=4"])  # last one wins
    summary2 = train_async(cfg2, acfg2, resume=True)
    assert summary2["steps"] == 1  # resumed at step 3, trained step 4 only
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3, 4]


def test_async_section_in_yaml_and_overrides(tmp_path):
    preset = tmp_path / "a.yaml"
    preset.write_text("model: {name: tiny-random}\nasync: {max_staleness: 3, num_workers: 1}\n")
    cfg, acfg = load_configs(str(preset), ["async.stale_policy=resample", "seed=5"])
    assert (acfg.max_staleness, acfg.num_workers, acfg.stale_policy) == (3, 1, "resample")
    assert acfg.groups_per_step == acfg.tasks_per_rollout == cfg.tasks.tasks_per_step
    assert cfg.seed == 5 and cfg.async_.max_staleness == 3
    with pytest.raises(ConfigError, match="unknown key 'async.workers'"):
        load_configs(str(preset), ["async.workers=2"])
    with pytest.raises(ConfigError, match="async.max_staleness: must be at least 0"):
        load_config(str(preset), ["async.max_staleness=-1"])


def test_cli_registers_train_async():
    from coderl.cli import build_parser

    args = build_parser().parse_args(["train-async", "c.yaml", "async.max_staleness=1", "--resume"])
    assert (args.config, args.overrides, args.resume) == ("c.yaml", ["async.max_staleness=1"], True)


def test_the_learner_masks_infra_failures_of_any_sampler(tmp_path, monkeypatch):
    # a sampler that is not the pipeline's (no pipeline info) still gets the one masking rule
    import coderl.asyncrl.trainer as T
    from coderl.asyncrl.types import Group, Job

    cfg = load_config(TOY, [*OVERRIDES, f"run_dir={tmp_path}"])
    learner, sampler = T.TrainLearner(cfg), T.EnvSampler(cfg)
    sampler.load_weights(0, learner.weights())
    task_id, task = T.task_stream(learner.run.env.tasks("train"), 0)(0)
    job = Job(0, task, task_id, seed=1)
    episodes = sampler.rollout(job, lambda: 0)
    for i, ep in enumerate(episodes):
        ep.info = [{"finish_reason": "error"}, {"failure": "infra"}, {}, {}][i]
    import coderl.train.run as R  # the one update both drivers call

    rows: list = []
    real = R.train_step
    monkeypatch.setattr(
        R,
        "train_step",
        lambda m, o, s, batch, *a, **kw: rows.append(batch.size) or real(m, o, s, batch, *a, **kw),
    )
    metrics = learner.train_step([Group(job, episodes, version=0)])
    assert rows == [2] and metrics["infra_failed_rate"] == 0.5 and metrics["reward/masked"] == 2
