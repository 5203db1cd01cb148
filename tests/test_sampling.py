"""Task samplers (``coderl.train.sampling``): the difficulty-calibrated pool's estimates, classes,
draws and state; the mix's allocation; and both in the drivers on the tiny random model (toy
task): a resumed run draws what the uninterrupted one drew, a curriculum draws each source in
its scheduled proportion, and ``train-async`` at ``max_staleness=0`` equals ``coderl train``."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from metrics_compare import assert_same_metrics, stable
from safetensors.torch import load_file

from coderl.asyncrl.trainer import train_async
from coderl.config import ConfigError, MixSourceConfig, PoolConfig, load_config
from coderl.envs import ENVIRONMENTS, EpisodeRecord, ToyEnvironment, build_environment
from coderl.metrics import read_jsonl
from coderl.train.loop import train
from coderl.train.sampling import MixSampler, PoolSampler, scheduled_weight
from coderl.train.signal import rollout_metrics
from coderl.trajectory import Trajectory

TOY = Path(__file__).parent.parent / "configs" / "toy.yaml"
FAST = [
    "progress=false",
    "tensorboard=false",
    "eval.before_after=false",
    "rollout.group_size=4",
    "rollout.max_new_tokens=4",
    "trainer.micro_batch_size=16",
]


@dataclass
class T:
    id: str


def _tasks(n: int, prefix: str = "t") -> list[T]:
    return [T(f"{prefix}{i}") for i in range(n)]


def _info(resolved: bool, valid: bool = True) -> dict:
    return {"resolved": resolved, "valid": valid, "total": float(resolved)}


def _pool(n=10, **kw) -> PoolSampler:
    cfg = PoolConfig(**{"window": 8, "settle": 4, "explore": 0.2, "revisit": 0.1, **kw})
    return PoolSampler(_tasks(n), seed=7, cfg=cfg, block=1)


def _set(pool: PoolSampler, outcomes: dict[str, list[int]]) -> None:
    for tid, xs in outcomes.items():
        pool.outcomes[tid] = list(xs)


# ---------------------------------------------------------------- the pool
def test_pool_estimates_count_resolved_grades_and_skip_masked_episodes():
    pool = _pool(3)
    tasks = [pool.tasks[0]] * 4 + [pool.tasks[1]] * 2
    infos = [_info(True), _info(False), _info(True, valid=False), _info(True)]
    infos += [_info(True, valid=False), _info(False, valid=False)]
    pool.observe(tasks, infos)
    assert pool.outcomes["t0"] == [1, 0, 1]  # the masked (infra) episode is not counted
    assert pool.estimate("t0") == pytest.approx(2 / 3)
    assert pool.outcomes["t1"] == [] and pool.status("t1") == "new"  # all masked: unseen
    pool.observe([pool.tasks[2]] * 10, [_info(True)] * 10)
    assert len(pool.outcomes["t2"]) == 8  # only the last `window` outcomes are kept


def test_pool_classes_and_revival():
    pool = _pool(5)
    _set(pool, {"t0": [1, 0], "t1": [1, 1, 1, 1], "t2": [0, 0, 0, 0], "t3": [0, 0, 0]})
    assert [pool.status(t.id) for t in pool.tasks] == [
        "active",
        "retired",  # solved by every one of at least `settle` samples
        "unsolved",
        "new",  # too few samples to settle
        "new",  # unseen
    ]
    pool.observe([pool.tasks[1], pool.tasks[2]], [_info(False), _info(False)])
    assert pool.status("t1") == "active" and pool.status("t2") == "unsolved"
    m = pool.metrics()
    assert m["pool/revived"] == 1 and m["pool/active"] == 2 and m["pool/unseen"] == 1
    # estimates of the 4 seen tasks: 0.5, 0.8, 0, 0 -> bins of width 0.2
    assert [m[f"pool/hist_{i}"] for i in range(5)] == [2, 0, 1, 0, 1]
    assert m["pool/mean"] == pytest.approx((0.5 + 0.8) / 4)


def test_pool_draws_mostly_active_tasks_weighted_by_their_variance():
    pool = _pool(10)
    _set(
        pool,
        {
            "t0": [1, 0, 0, 0, 0, 0, 0, 0],  # p = 1/8
            "t1": [1, 0],  # p = 1/2: the most signal
            "t4": [1] * 4,
            "t5": [1] * 4,  # retired
            "t6": [0] * 4,
            "t7": [0] * 8,  # unsolved
        },
    )
    statuses = {t.id: pool.status(t.id) for t in pool.tasks}
    draws = [pool.at(i)[0] for i in range(4000)]  # nothing observed: the state is fixed
    by_status = Counter(statuses[d] for d in draws)
    assert by_status["active"] / 4000 == pytest.approx(0.7, abs=0.03)
    assert by_status["new"] / 4000 == pytest.approx(0.2, abs=0.03)
    assert (by_status["retired"] + by_status["unsolved"]) / 4000 == pytest.approx(0.1, abs=0.02)
    c = Counter(draws)
    # weights p(1-p): 1/4 against 7/64, so t1 is drawn about 2.3 times as often as t0
    assert c["t1"] / c["t0"] == pytest.approx((1 / 4) / (7 / 64), rel=0.15)
    assert pool.metrics()["pool/drawn_active"] == by_status["active"]


def test_pool_draws_new_tasks_while_none_is_active_and_distinct_tasks_per_block():
    cfg = PoolConfig(window=8, settle=4, explore=0.0, revisit=0.0)
    pool = PoolSampler(_tasks(6), seed=1, cfg=cfg, block=6)
    assert sorted(pool.at(i)[0] for i in range(6)) == [f"t{i}" for i in range(6)]
    _set(pool, {f"t{i}": [0] * 4 for i in range(6)})  # everything unsolved: revisited anyway
    assert len({pool.at(i)[0] for i in range(6, 12)}) == 6


def test_pool_draws_depend_only_on_seed_block_and_state():
    a, b = _pool(10), _pool(10)
    for p in (a, b):
        _set(p, {"t0": [1, 0], "t1": [0, 1, 1], "t2": [1, 1, 1, 1]})
        p.take(3)
    state = json.loads(json.dumps(a.state_dict()))  # it goes through state.json
    c = _pool(10)
    c.load_state_dict(state)
    c.position = a.position
    assert [t.id for _, t in a.take(20)] == [t.id for _, t in c.take(20)]
    assert [t.id for _, t in b.take(20)] == [t.id for _, t in _pool_like(state, 3).take(20)]


def _pool_like(state: dict, position: int) -> PoolSampler:
    p = _pool(10)
    p.load_state_dict(state)
    p.position = position
    return p


def test_pool_config_is_checked():
    with pytest.raises(ConfigError, match="settle=9 must be <= window=8"):
        load_config(None, ["tasks.pool.window=8", "tasks.pool.settle=9"])
    with pytest.raises(ConfigError, match="tasks.mix needs tasks.source=mix"):
        load_config(None, ["tasks.mix=[{source: toy}]"])


# ---------------------------------------------------------------- the mix
def _mix_env(*entries: str):
    mix = "tasks.mix=[" + ", ".join(entries) + "]"
    return build_environment(load_config(None, ["tasks.source=mix", mix]))


def test_a_mix_grades_each_task_with_its_own_source():
    env = _mix_env(
        "{source: toy, name: a, options: {prefix: a, modulus: 2}}",
        "{source: toy, name: b, options: {prefix: b, modulus: 4}}",
    )
    tasks = env.tasks("train")
    assert [t.id for t in tasks[:4]] == ["a/train/0", "b/train/0", "a/train/1", "b/train/1"]
    episodes = [EpisodeRecord(t.id, Trajectory(), answer=[2, 4, 6, 1]) for t in tasks[:2]]
    grades = env.grade(tasks[:2], episodes)
    # tokens 2, 4, 6 are 0 mod 2 (3 of 4) but only 4 is 0 mod 4 (1 of 4)
    assert [g.fraction_passed for g in grades] == [0.75, 0.25]
    assert [env.owner(t) for t in tasks[:2]] == ["a", "b"]
    with pytest.raises(ConfigError, match="tasks.limit does not apply to a mix"):
        load_config(None, ["tasks.source=mix", "tasks.mix=[{source: toy}]", "tasks.limit=3"])


def test_task_ids_must_be_unique_across_sources():
    env = _mix_env("{source: toy, name: a}", "{source: toy, name: b}")
    with pytest.raises(ValueError, match="'toy/train/0' is in sources 'a' and 'b'"):
        env.tasks("train")


def _mix(weights: dict[str, object], block: int, samplers=None) -> MixSampler:
    sources = [(MixSourceConfig(source="toy", name=k, weight=w), _tasks(5, k)) for k, w in weights.items()]  # fmt: skip
    kinds = {k: (samplers or {}).get(k, "uniform") for k in weights}
    return MixSampler(sources, kinds, seed=3, pool=PoolConfig(), block=block)


def test_scheduled_weights_interpolate_between_points_and_hold_beyond_them():
    w = [(2, 1.0), (6, 0.0)]
    assert [scheduled_weight(w, s) for s in (0, 2, 4, 6, 9)] == [1.0, 1.0, 0.5, 0.0, 0.0]
    assert scheduled_weight(2, 5) == 2.0


def test_mix_counts_track_the_scheduled_shares_within_one_task():
    mix = _mix({"a": 1.0, "b": 1.0, "c": 1.0}, block=2, samplers={"b": "pool"})
    counts: Counter[str] = Counter()
    for step in range(30):
        mix.step = step
        counts.update(mix.source_of(t) for _, t in mix.take(2))
        target = 2 * (step + 1) / 3
        assert all(abs(counts[k] - target) < 1 for k in "abc"), (step, counts)


def test_a_source_with_weight_zero_is_not_drawn():
    mix = _mix({"a": [(0, 1.0), (3, 1.0), (4, 0.0)], "b": 1.0}, block=4)
    per_step = []
    for step in range(8):
        mix.step = step
        per_step.append(Counter(mix.source_of(t) for _, t in mix.take(4))["a"])
    assert per_step == [2, 2, 2, 2, 0, 0, 0, 0]


def test_rollout_metrics_count_groups_with_signal_before_any_drop():
    mix = _mix({"a": 1.0, "b": 1.0}, block=2)
    a, b = mix.by_id["a0"], mix.by_id["b0"]
    tasks = [a, a, b, b, b, b]
    keys = ["a0#0", "a0#0", "b0#1", "b0#1", "b0#2", "b0#2"]
    infos = [_info(True), _info(False), _info(True), _info(True), _info(False), _info(True)]
    m = rollout_metrics(mix, tasks, keys, infos)
    assert m["signal/groups"] == 3 and m["signal/groups_with_signal"] == pytest.approx(2 / 3)
    assert (m["mix/a/tasks"], m["mix/b/tasks"]) == (1, 2)
    assert (m["mix/a/resolved"], m["mix/b/resolved"]) == (0.5, 0.75)


# ---------------------------------------------------------------- in the drivers
class RecToy(ToyEnvironment):
    """The toy task, logging the task ids and seed of every rollout to ``log``."""

    log: list = []

    def rollout(self, policy, tasks, params, group_size):
        RecToy.log.append(([t.id for t in tasks], params.seed))
        return super().rollout(policy, tasks, params, group_size)


@pytest.fixture
def rec(monkeypatch):
    RecToy.log = []
    monkeypatch.setitem(
        ENVIRONMENTS, "rec", lambda cfg: RecToy(cfg.rollout.max_new_tokens, **cfg.tasks.options)
    )
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield RecToy
    torch.set_num_threads(before)


MIX = (
    "tasks.mix=[{source: rec, name: a, options: {prefix: a, n_train: 6}, "
    "weight: [[0, 3.0], [2, 3.0], [3, 1.0]]}, "
    "{source: rec, name: b, options: {prefix: b, n_train: 6}, sampler: pool}]"
)
POOL = ["tasks.source=rec", "tasks.sampler=pool", "tasks.pool.settle=2", "tasks.tasks_per_step=3"]
CURRICULUM = ["tasks.source=mix", MIX, "tasks.tasks_per_step=4", "tasks.pool.settle=2"]


def _interrupted_equals_uninterrupted(tmp_path, rec, over, cut, steps):
    common = [*FAST, *over, "trainer.checkpoint_every=1", "trainer.keep_checkpoints=9"]
    train(load_config(TOY, [*common, f"trainer.steps={steps}", f"run_dir={tmp_path / 'ref'}"]))
    ref_log, rec.log = rec.log, []
    cut_dir = tmp_path / "cut"
    train(load_config(TOY, [*common, f"trainer.steps={cut}", f"run_dir={cut_dir}"]))
    train(load_config(TOY, [*common, f"trainer.steps={steps}", f"run_dir={cut_dir}"]), resume=True)
    assert rec.log == ref_log  # the same tasks, in the same rollouts, with the same seeds
    ref = stable(read_jsonl(tmp_path / "ref" / "metrics.jsonl"))
    got = read_jsonl(cut_dir / "metrics.jsonl")
    assert [r["step"] for r in got] == list(range(1, steps + 1))
    assert_same_metrics(ref, got)
    last = f"checkpoints/step-{steps:06d}/state.json"
    a, b = (json.loads((d / last).read_text()) for d in (tmp_path / "ref", cut_dir))
    assert a == b and "sampler" in a
    return ref_log, ref


def test_a_resumed_pool_run_draws_the_tasks_of_the_uninterrupted_one(tmp_path, rec):
    over = [*POOL, "dynamic_sampling.mode=resample", "dynamic_sampling.max_resample=1"]
    over += ["tasks.pool.prepass_samples=2", "reward.tests=resolved"]  # ties: flat groups
    log, metrics = _interrupted_equals_uninterrupted(tmp_path, rec, over, cut=2, steps=4)
    resampled = [r["dynamic/resampled_groups"] for r in metrics]
    assert sum(resampled) > 0  # resample rounds drew from the pool, and resumed exactly
    assert len(log) == 6 + 4 + sum(r > 0 for r in resampled)  # pre-pass: 16 tasks, 3 a rollout
    m = metrics[-1]
    assert m["pool/unseen"] == 0 and m["pool/active"] > 0  # the pre-pass saw every task
    assert sum(r["pool/drawn_active"] for r in metrics) > 0


def test_a_curriculum_draws_each_source_in_its_scheduled_share_and_resumes(tmp_path, rec):
    log, metrics = _interrupted_equals_uninterrupted(tmp_path, rec, CURRICULUM, cut=3, steps=5)
    # weight of a: 3 (steps 0-2), then 1 against b's 1: 3 of 4 tasks, then 2 of 4
    assert [m["mix/a/tasks"] for m in metrics] == [3, 3, 3, 2, 2]
    assert [m["mix/b/tasks"] for m in metrics] == [1, 1, 1, 2, 2]
    assert [m["mix/a/weight"] for m in metrics] == [0.75, 0.75, 0.75, 0.5, 0.5]
    drawn = Counter(tid[0] for ids, _ in log for tid in ids)  # each source rolled out alone
    assert drawn == {"a": 13, "b": 7}
    assert "pool/b/active" in metrics[-1] and "pool/a/active" not in metrics[-1]


@pytest.mark.parametrize(
    "over", [[*POOL, "tasks.pool.prepass_samples=2"], CURRICULUM], ids=["pool", "mix"]
)
def test_train_async_at_staleness_zero_draws_and_trains_what_train_does(tmp_path, rec, over):
    common = [*FAST, *over, "trainer.steps=3", "trainer.checkpoint_every=3"]
    train(load_config(TOY, [*common, f"run_dir={tmp_path / 'sync'}"]))
    sync_log, rec.log = rec.log, []
    cfg = load_config(
        TOY,
        [*common, f"run_dir={tmp_path / 'async'}", "async.max_staleness=0", "async.num_workers=2"],
    )
    train_async(cfg)
    assert rec.log[: len(sync_log)] == sync_log
    ckpt = "checkpoints/step-000003/trainable.safetensors"
    a, b = (load_file(str(tmp_path / d / ckpt)) for d in ("sync", "async"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ma = read_jsonl(tmp_path / "sync" / "metrics.jsonl")
    mb = read_jsonl(tmp_path / "async" / "metrics.jsonl")
    keys = [k for k in ma[0] if k.startswith(("pool/", "mix/", "signal/"))]
    assert "signal/groups_with_signal" in keys
    for key in [*keys, "loss", "reward/mean"]:
        assert [m[key] for m in ma] == pytest.approx([m[key] for m in mb], nan_ok=True), key
