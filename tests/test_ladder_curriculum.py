"""The repository ladder's curriculum and in-loop synthesis: levels advance by pass rate (not by
step count), synthesis proposes tasks at the level the pools point to and sends each to its
level's entry, and a resumed run draws exactly what an uninterrupted one does.

A scripted policy resolves a task with a chance that falls with its level; the sampler is the
preset's (configs/repo-ladder.yaml: a mix entry per level, the curriculum, synthesis into
``repo-L{level}``) over ladder variants of shipped toolz tasks. The scripted proposer stands in
for repository synthesis, which runs a test suite per mutant (about 20 s a request on six on a
loaded 2-core machine): ``test_a_real_repository_request_makes_level_variants_in_sandboxes``
runs one real request.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from coderl.config import load_config
from coderl.tasks import ladder
from coderl.tasks.ladder import ladder_task, ladder_tasks, level_of
from coderl.tasks.repos import load_repo_tasks
from coderl.tasks.spec import Task
from coderl.train import synth as S
from coderl.train.curriculum import Curriculum
from coderl.train.sampling import MixSampler

ROOT = Path(__file__).parent.parent
PRESET = load_config(ROOT / "configs" / "repo-ladder.yaml")
BASE = [t for t in load_repo_tasks("train") if t.id.startswith("toolz-")]
EASE = [0.9, 0.6, 0.3, 0.05]
"""The scripted policy's chance of resolving a task, by ladder level."""


def scripted_proposer(request: dict) -> dict:
    """Deterministic in the request, like the real one: other shipped toolz tasks (the
    "synthesised" bugs) at the requested level, less the excluded ids."""
    rng = random.Random(request["key"])
    pool = BASE[8:]
    picked = [pool[rng.randrange(len(pool))] for _ in range(request["n"])]
    made = [ladder_task(t, int(request["level"])) for t in picked]
    made = [t for t in made if t.id not in set(request["exclude"])]
    return {"proposed": request["n"], "tasks": [t.model_dump(mode="json") for t in made]}


S.PROPOSERS["ladder-scripted"] = S.Proposer(
    scripted_proposer,
    Task.model_validate,
    lambda t: t.model_dump(mode="json"),
    ladder.level_of,
    ladder.MAX_LEVEL,
)


def sampler(ease_scale: float = 1.0) -> S.SynthSampler:
    t = PRESET.tasks
    sources = [(m, ladder_tasks(BASE[:8], m.options["ladder"])) for m in t.mix]
    samplers = {m.label(): "pool" for m in t.mix}
    cur = Curriculum(t.curriculum)
    mix = MixSampler(sources, samplers, 3, t.pool, t.tasks_per_step, cur)
    cfg = t.synth.model_copy(update={"proposer": "ladder-scripted", "executor": "thread"})
    s = S.SynthSampler(mix, cfg, 3)
    s.ease_scale = ease_scale  # type: ignore[attr-defined]
    return s


def step(s: S.SynthSampler, G: int = 4) -> tuple[list[str], dict[str, float]]:
    drawn = [t for _, t in s.take(PRESET.tasks.tasks_per_step)]
    owners = [t for t in drawn for _ in range(G)]
    scale = s.ease_scale  # type: ignore[attr-defined]
    infos = [
        {
            "valid": True,
            "resolved": random.Random(f"{t.id}/{s.step}/{j}").random() < scale * EASE[level_of(t)],
        }
        for j, t in enumerate(owners)
    ]
    s.observe(owners, infos)
    m = s.metrics()
    s.step += 1
    return [t.id for t in drawn], m


def run(s: S.SynthSampler, n: int) -> tuple[list[list[str]], list[dict[str, float]]]:
    out = [step(s) for _ in range(n)]
    return [d for d, _ in out], [m for _, m in out]


def test_levels_advance_by_pass_rate_and_synthesis_feeds_each_level_its_own_tasks():
    s = sampler()
    draws, ms = run(s, 24)
    cur = s.inner.curriculum
    assert cur.stage >= 1 and cur.advanced_at  # L0 is easy: it advanced on its pass rate
    first = [level_of(s.inner.by_id[i]) for i in draws[0]]
    assert first == [0] * len(first)  # stage 0 draws only L0
    assert ms[-1]["curriculum/stage"] == float(cur.stage)
    admitted = sum(m["synth/admitted"] for m in ms)
    assert admitted > 0
    for label, pool in s.inner.subs.items():  # every admitted task went to its level's entry
        assert {level_of(t) for t in pool.tasks} == {int(label[-1])}
    levels = {m["synth/level"] for m in ms if m["synth/requested"]}
    assert levels and levels <= {0.0, 1.0, 2.0, 3.0}
    assert any(k.startswith("pool/level") for k in ms[-1])

    stuck = sampler(ease_scale=0.0)  # nothing resolves: the curriculum never moves
    run(stuck, 24)
    assert stuck.inner.curriculum.stage == 0


def test_the_ladder_curriculum_and_synthesis_resume_exactly():
    whole = sampler()
    draws, ms = run(whole, 16)

    first = sampler()
    d1, _ = run(first, 7)
    saved = json.loads(json.dumps({"cursor": first.position, "sampler": first.state_dict()}))
    resumed = sampler()  # a fresh process: the shipped variants only
    resumed.position = saved["cursor"]
    resumed.load_state_dict(saved["sampler"])
    resumed.step = 7
    d2, ms2 = run(resumed, 9)
    assert d1 + d2 == draws  # the same tasks, step for step
    assert resumed.inner.curriculum.state_dict() == whole.inner.curriculum.state_dict()
    for label in whole.inner.subs:
        a, b = resumed.inner.subs[label], whole.inner.subs[label]
        assert [t.id for t in a.tasks] == [t.id for t in b.tasks] and a.outcomes == b.outcomes
    keys = ("synth/admitted", "synth/level", "synth/pool_tasks", "curriculum/stage")
    assert [[m[k] for k in keys] for m in ms2] == [[m[k] for k in keys] for m in ms[7:]]


def test_the_plan_reads_the_ladders_levels():
    cfg = PRESET.tasks.synth
    stat = lambda p, n=32.0: {"tasks": 8.0, "active": 0.0, "samples": n, "pass_rate": p}  # noqa: E731
    assert S.plan({0: stat(0.9)}, 0, cfg, ladder.MAX_LEVEL) == 1  # L0 saturated, no L1 yet
    assert S.plan({3: stat(0.9)}, 0, cfg, ladder.MAX_LEVEL) == 3  # the top: stays
    assert S.plan({2: stat(0.0)}, 0, cfg, ladder.MAX_LEVEL) == 1  # too hard: one down


needs_sandbox = pytest.mark.skipif(
    __import__("shutil").which("bwrap") is None or __import__("os").geteuid() != 0,
    reason="needs bubblewrap and root (make sysdeps); CI has both",
)


@needs_sandbox
def test_a_real_repository_request_makes_level_variants_in_sandboxes():
    """Repository synthesis for real, on six (the library CI builds): mutants run against the
    test suite in sandboxes; what is kept comes back as level-1 variants of new tasks."""
    from coderl.envbuild.build import build_env
    from coderl.synth.repo import synthesise_ladder

    build_env("six==1.17.0")
    request = {"level": 1, "n": 1, "key": "t", "exclude": [], "repos": ["six"], "max_tries": 6}
    out = synthesise_ladder(request)
    assert 1 <= out["proposed"] <= 6
    tasks = [Task.model_validate(t) for t in out["tasks"]]
    assert len(tasks) == 1  # the first mutant of this key is kept (deterministic)
    assert all(level_of(t) == 1 and t.id.startswith("six-1.17.0/") for t in tasks)
    assert all("The bug is in six.py." in t.problem_statement for t in tasks)
    with pytest.raises(ValueError, match="not training repositories"):
        synthesise_ladder({**request, "repos": ["idna"]})
