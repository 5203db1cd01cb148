"""Synthesis inside the loop (plan, admission, resume), the pass-rate curriculum, and their config."""

from __future__ import annotations

import dataclasses
import json
import math
import random
from types import SimpleNamespace

import pytest
import torch
from test_sampling import FAST, TOY, RecToy
from test_tasks_fnrepair import needs_sandbox

from coderl.config import (
    ConfigError,
    CurriculumConfig,
    MixSourceConfig,
    PoolConfig,
    SynthConfig,
    load_config,
)
from coderl.envs.toy import ToyTask
from coderl.synth.fnrepair import level_of, synthesise, validate
from coderl.tasks.spec import Task
from coderl.train import synth as S
from coderl.train.curriculum import Curriculum
from coderl.train.sampling import MixSampler, PoolSampler

EASE = [0.9, 0.6, 0.3, 0.1, 0.0]
"""The scripted policy's chance of resolving a task, by difficulty level."""


def toy_task(tid: str, level: int, split: str = "train") -> Task:
    return Task(
        id=tid,
        kind="function",
        env_id="python3",
        problem_statement="fix it",
        FAIL_TO_PASS=["hidden_test.py::check"],
        gold_patch="x",
        source="toy",
        license="MIT",
        split=split,
        extra={"fnrepair": {"level": level}},  # type: ignore[arg-type]
    )


def toy_proposer(request: dict) -> dict:
    """Deterministic in the request, like the real one; one held-out task that must be refused."""
    rng = random.Random(request["key"])
    lv = int(request["level"])
    made = [toy_task(f"syn/L{lv}/{rng.randrange(10**9)}", lv) for _ in range(request["n"])]
    made.append(toy_task(f"syn/heldout/{rng.randrange(10**9)}", lv, split="heldout"))
    return {"proposed": len(made) + 1, "tasks": [t.model_dump(mode="json") for t in made]}


S.PROPOSERS["toy"] = S.Proposer(toy_proposer, Task.model_validate, lambda t: t.model_dump())
CFG = SynthConfig(
    enabled=True, proposer="toy", min_active=3, min_samples=8, per_request=3, executor="thread"
)
POOL = PoolConfig(window=8, settle=4, explore=0.25, revisit=0.05)


def sampler(block: int = 4) -> S.SynthSampler:
    tasks = [toy_task(f"seed/{i}", 0) for i in range(4)]
    return S.SynthSampler(PoolSampler(tasks, 7, POOL, block), CFG, 7)


def step(s: S.SynthSampler, n: int, G: int = 4) -> tuple[list[str], dict[str, float]]:
    drawn = [t for _, t in s.take(n)]
    owners = [t for t in drawn for _ in range(G)]
    infos = [
        {
            "valid": True,
            "resolved": random.Random(f"{t.id}/{s.step}/{j}").random() < EASE[level_of(t)],
        }
        for j, t in enumerate(owners)
    ]
    s.observe(owners, infos)
    m = s.metrics()
    s.step += 1
    return [t.id for t in drawn], m


def test_plan_hand_worked():
    stat = lambda n, samples, p, active=0.0: {  # noqa: E731
        "tasks": n,
        "active": active,
        "samples": samples,
        "pass_rate": p,
    }
    assert S.plan({}, 0, CFG) == 0  # nothing known: the start level
    assert S.plan({0: stat(4, 8, 0.5, 3)}, 3, CFG) is None  # enough active, nothing saturated
    assert S.plan({0: stat(4, 8, 0.9)}, 3, CFG) == 1  # saturated, no level-1 tasks yet
    assert S.plan({0: stat(4, 8, 0.9), 1: stat(3, 0, math.nan)}, 3, CFG) is None  # supplied
    assert S.plan({0: stat(4, 8, 0.5), 1: stat(4, 8, 0.2)}, 0, CFG) == 0  # nearest 0.5
    assert S.plan({1: stat(4, 8, 0.0)}, 0, CFG) == 0  # too hard: one level down
    assert S.plan({0: stat(4, 4, 0.9)}, 0, CFG) == 0  # too few samples to count


def test_level_stats_pool_outcomes():
    s = sampler()
    pool = s.pool()
    pool.admit([toy_task("x/1", 2), toy_task("x/2", 3)])
    pool.outcomes.update({"seed/0": [1, 0], "seed/1": [1, 1, 1, 1], "x/1": [0]})
    st = S.level_stats(pool)
    assert st[0] == {"tasks": 4.0, "active": 1.0, "samples": 6.0, "pass_rate": 5 / 6}
    assert st[2] == {"tasks": 1.0, "active": 0.0, "samples": 1.0, "pass_rate": 0.0}
    assert st[3]["samples"] == 0.0 and math.isnan(st[3]["pass_rate"]) and "solved" not in st[3]


def run_steps(s: S.SynthSampler, n: int) -> tuple[list[list[str]], list[dict[str, float]]]:
    draws, ms = [], []
    for _ in range(n):
        d, m = step(s, 4)
        draws.append(d)
        ms.append(m)
    return draws, ms


def test_synthesis_admits_training_tasks_and_resume_is_exact():
    whole = sampler()
    draws, ms = run_steps(whole, 10)
    admitted = sum(m["synth/admitted"] for m in ms)
    assert admitted > 0 and sum(m["synth/requested"] for m in ms) >= admitted
    assert all(t.split == "train" for t in whole.pool().tasks)  # the held-out one was refused
    assert any(m["synth/validated"] > m["synth/admitted"] for m in ms)
    assert {level_of(t) for t in whole.pool().tasks} - {0}  # it moved up from level 0
    assert any(k.startswith("synth/admitted_L") for m in ms for k in m)

    first = sampler()
    d1, _ = run_steps(first, 5)
    saved = json.loads(json.dumps({"cursor": first.position, "sampler": first.state_dict()}))
    resumed = sampler()  # a fresh process: the initial tasks only
    resumed.position = saved["cursor"]
    resumed.load_state_dict(saved["sampler"])
    resumed.step = 5
    d2, ms2 = run_steps(resumed, 5)
    assert d1 + d2 == draws  # the same next tasks
    assert [t.id for t in resumed.pool().tasks] == [t.id for t in whole.pool().tasks]
    assert resumed.pool().outcomes == whole.pool().outcomes
    keys = ("synth/admitted", "synth/level", "synth/pool_tasks")
    assert [[m[k] for k in keys] for m in ms2] == [[m[k] for k in keys] for m in ms[5:]]


@needs_sandbox
def test_real_request_validates_in_sandboxes():
    out = synthesise({"level": 1, "n": 1, "key": "t", "exclude": []})
    tasks = [Task.model_validate(t) for t in out["tasks"]]
    assert out["proposed"] == 1 and len(tasks) == 1
    (t,) = tasks
    assert t.split == "train" and level_of(t) == 1 and validate(t) is None
    again = synthesise({"level": 1, "n": 1, "key": "t", "exclude": []})
    assert [t["id"] for t in again["tasks"]] == [t.id for t in tasks]  # deterministic


def test_curriculum_advances_by_pass_rate_hand_worked():
    c = Curriculum(
        CurriculumConfig(order=["a", "b", "c"], advance_at=0.5, min_samples=4, window=4, replay=0.2)
    )
    ok = lambda *r: [{"valid": True, "resolved": x} for x in r]  # noqa: E731
    assert c.weights(["a", "b", "c", "d"]) == {"a": 1.0, "b": 0.0, "c": 0.0, "d": 0.0}
    c.observe("a", ok(1, 0, 0))  # 3 samples: too few to advance
    c.observe("b", ok(1, 1, 1, 1))  # not the current stage: recorded, no advance
    assert c.stage == 0
    c.observe("a", ok(1))  # 4 samples, rate 2/4 = 0.5 >= 0.5
    assert c.stage == 1 and c.weights(["a", "b", "c"]) == {"a": 0.2, "b": 0.8, "c": 0.0}
    c.observe("b", ok(1, 1, 1) + [{"valid": False, "resolved": True}])  # 3 valid since stage 1
    assert c.stage == 1
    c.observe("b", ok(1))
    assert c.stage == 2 and c.weights(["a", "b", "c"]) == pytest.approx(
        {"a": 0.1, "b": 0.1, "c": 0.8}
    )
    restored = Curriculum(c.cfg)
    restored.load_state_dict(json.loads(json.dumps(c.state_dict())))
    assert restored.state_dict() == c.state_dict()


def test_mix_follows_the_curriculum_and_admits_to_its_pool():
    a = [toy_task(f"a/{i}", 0) for i in range(4)]
    b = [toy_task(f"b/{i}", 0) for i in range(4)]
    cur = Curriculum(CurriculumConfig(order=["a", "b"], min_samples=2, window=4, replay=0.0))
    mix = MixSampler(
        [
            (MixSourceConfig(source="fnrepair", name="a"), a),
            (MixSourceConfig(source="humaneval", name="b"), b),
        ],
        {"a": "pool", "b": "uniform"},
        0,
        POOL,
        4,
        cur,
    )
    first = [t.id for _, t in mix.take(4)]
    assert all(i.startswith("a/") for i in first)
    mix.observe([mix.by_id[i] for i in first], [{"valid": True, "resolved": True}] * 4)
    assert mix.metrics()["curriculum/stage"] == 1.0
    assert all(t.id.startswith("b/") for _, t in mix.take(4))
    assert [t.id for t in mix.admit([toy_task("a/new", 1), a[0]], "a")] == ["a/new"]
    assert mix.source_of(mix.by_id["a/new"]) == "a"
    with pytest.raises(ValueError, match="not a pool source"):
        mix.admit([toy_task("b/new", 1)], "b")


def test_resuming_a_run_without_synthesis_keeps_its_pool():
    plain = PoolSampler([toy_task(f"seed/{i}", 0) for i in range(4)], 7, POOL, 4)
    plain.outcomes["seed/1"] = [1, 0]
    s = sampler()
    s.load_state_dict(json.loads(json.dumps(plain.state_dict())))
    assert s.pool().outcomes["seed/1"] == [1, 0] and s.tick == 0


def test_synthesis_into_a_mix_entry():
    a = [toy_task(f"a/{i}", 0) for i in range(4)]
    b = [toy_task(f"b/{i}", 0) for i in range(4)]
    mix = MixSampler(
        [
            (MixSourceConfig(source="fnrepair", name="a"), a),
            (MixSourceConfig(source="humaneval", name="b"), b),
        ],
        {"a": "pool", "b": "uniform"},
        0,
        POOL,
        4,
    )
    s = S.SynthSampler(mix, CFG.model_copy(update={"source": "a"}), 0)
    for _ in range(3):
        step(s, 4)
    new = [t for t in s.pool().tasks if t.id.startswith("syn/")]
    assert new and all(mix.source_of(t) == "a" for t in new)
    assert not any(t.id.startswith("syn/") for t in mix.subs["b"].tasks)


def test_config_refuses_synthesis_without_a_pool_and_unknown_stages():
    with pytest.raises(ConfigError, match="needs tasks.sampler=pool"):
        load_config(None, ["tasks.synth.enabled=true"])
    mix = ["tasks.source=mix", "tasks.mix=[{source: fnrepair}, {source: humaneval}]"]
    with pytest.raises(ConfigError, match="must name a tasks.mix entry"):
        load_config(None, [*mix, "tasks.synth.enabled=true", "tasks.synth.source=humaneval"])
    with pytest.raises(ConfigError, match="distinct tasks.mix labels"):
        load_config(None, [*mix, "tasks.curriculum={order: [fnrepair, repo]}"])
    cfg = load_config(
        None,
        [
            *mix,
            "tasks.sampler=pool",
            "tasks.synth.enabled=true",
            "tasks.synth.source=fnrepair",
            "tasks.curriculum={order: [fnrepair, humaneval]}",
        ],
    )
    assert cfg.tasks.synth.source == "fnrepair"


def test_build_sampler_wraps_the_pool():
    from coderl.train.sampling import build_sampler

    cfg = load_config(None, ["tasks.sampler=pool", "tasks.synth.enabled=true"])
    env = SimpleNamespace(tasks=lambda split: [toy_task("t/0", 0), toy_task("t/1", 1)])
    s = build_sampler(cfg, env)
    assert isinstance(s, S.SynthSampler) and isinstance(s.inner, PoolSampler)


# ---------------------------------------------------------------- through coderl train
def toy_env_proposer(request: dict) -> dict:
    """New toy tasks (the harness-free task of ``coderl.envs.toy``), deterministic in the request."""
    rng = random.Random(request["key"])
    made = []
    for _ in range(request["n"]):
        i = rng.randrange(10**6)
        made.append(
            {
                "id": f"syn/{i}",
                "prompt_ids": [3 + (i + j) % 97 for j in range(5)],
                "residue": 0,
                "modulus": 4,
                "split": "train",
            }
        )
    return {"proposed": len(made), "tasks": made}


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: more threads only contend
    yield
    torch.set_num_threads(before)


def test_kill_and_resume_gives_the_same_pool_and_next_tasks(tmp_path, monkeypatch, one_thread):
    from coderl.envs import ENVIRONMENTS
    from coderl.metrics import read_jsonl
    from coderl.train.loop import train

    monkeypatch.setitem(ENVIRONMENTS, "rec", lambda cfg: RecToy(cfg.rollout.max_new_tokens))
    monkeypatch.setitem(
        S.PROPOSERS,
        "toyenv",
        S.Proposer(toy_env_proposer, lambda d: ToyTask(**d), dataclasses.asdict),
    )
    common = [
        *FAST,
        "tasks.source=rec",
        "tasks.sampler=pool",
        "tasks.pool.settle=2",
        "tasks.tasks_per_step=3",
        "tasks.synth.enabled=true",
        "tasks.synth.proposer=toyenv",
        "tasks.synth.executor=thread",
        "tasks.synth.min_active=100",
        "tasks.synth.per_request=2",
        "trainer.checkpoint_every=1",
    ]
    RecToy.log = []
    train(load_config(TOY, [*common, "trainer.steps=4", f"run_dir={tmp_path / 'ref'}"]))
    ref_log, RecToy.log = RecToy.log, []
    cut = tmp_path / "cut"
    train(load_config(TOY, [*common, "trainer.steps=2", f"run_dir={cut}"]))  # "killed" here
    from coderl.config import ConfigError
    from coderl.train.resume import resume_config

    with pytest.raises(ConfigError, match="tasks.synth.enabled True -> False"):
        resume_config(cut, None, ["trainer.steps=4", "tasks.synth.enabled=false"])  # pool lost
    train(load_config(TOY, [*common, "trainer.steps=4", f"run_dir={cut}"]), resume=True)
    assert RecToy.log == ref_log  # the same next tasks, with the same seeds
    assert any(i.startswith("syn/") for ids, _ in ref_log for i in ids)  # admitted were drawn
    last = "checkpoints/step-000004/state.json"
    a, b = (json.loads((d / last).read_text()) for d in (tmp_path / "ref", cut))
    assert a["sampler"] == b["sampler"]  # the same pool: tasks, outcomes, synthesis state
    assert len(a["sampler"]["synth"]["admitted"]) == 8  # 2 a tick, from the tick before step 1
    keys = ("synth/admitted", "synth/pool_tasks", "synth/admitted_total")
    ref, got = (read_jsonl(d / "metrics.jsonl") for d in (tmp_path / "ref", cut))
    assert [[m[k] for k in keys] for m in got] == [[m[k] for k in keys] for m in ref]
