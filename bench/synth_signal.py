"""The pool's active band and groups with signal, with and without ``tasks.synth``, on simulated
tasks and a simulated policy that improves (no model, no sandbox).

Each task has a difficulty level 0-4. The simulated policy's pass rate on a level-``l`` task at
step ``s`` is ``sigmoid(skill(s) - 2 l)`` with ``skill(s) = skill0 + rate * s``: it starts able
to do some level-0 tasks and outgrows them. A group is ``--group`` Bernoulli outcomes; it has
signal when they are not all equal (``signal/groups_with_signal``). The initial pool is
``--tasks`` level-0 and level-1 tasks. With synthesis, :class:`coderl.train.synth.SynthSampler`
runs its real plan and admission (``coderl.train.synth.plan``) with an in-process proposer that
makes simulated tasks at the requested level (validation always passes: this measures the
loop's control, not the repair tasks). Prints, per block of steps, the mean active band and the
share of groups with signal, and the ratio synth / no synth over the last half of the run.

    .venv/bin/python bench/synth_signal.py
    .venv/bin/python bench/synth_signal.py --steps 120 --rate 0.08
"""

from __future__ import annotations

import argparse
import math
import os
import random

import numpy as np

from coderl.config import PoolConfig, SynthConfig
from coderl.tasks.spec import Task
from coderl.train import synth as S
from coderl.train.sampling import PoolSampler


def _task(tid: str, level: int) -> Task:
    return Task(
        id=tid,
        kind="function",
        env_id="python3",
        problem_statement="simulated",
        FAIL_TO_PASS=["t"],
        gold_patch="x",
        source="sim",
        license="MIT",
        extra={"fnrepair": {"level": level}},
    )


def _proposer(request: dict) -> dict:
    rng = random.Random(request["key"])
    lv = int(request["level"])
    made = [_task(f"syn/L{lv}/{rng.randrange(10**9)}", lv) for _ in range(request["n"])]
    return {"proposed": len(made), "tasks": [t.model_dump(mode="json") for t in made]}


def run(a: argparse.Namespace, synth: bool) -> tuple[list[float], list[float]]:
    """(active band per step, groups-with-signal share per step)."""
    tasks = [_task(f"t{i}", i % 2) for i in range(a.tasks)]
    pool = PoolSampler(tasks, a.seed, PoolConfig(), a.per_step)
    cfg = SynthConfig(
        enabled=True,
        proposer="sim",
        executor="thread",
        min_active=a.min_active,
        per_request=a.per_request,
    )
    sampler = S.SynthSampler(pool, cfg, a.seed) if synth else pool
    draws = np.random.default_rng(a.seed + 1)
    active, signal = [], []
    for step in range(a.steps):
        skill = a.skill0 + a.rate * step
        owners, infos, with_signal = [], [], 0
        for _, t in sampler.take(a.per_step):
            p = 1 / (1 + math.exp(-(skill - 2 * t.extra["fnrepair"]["level"])))
            out = draws.random(a.group) < p
            with_signal += bool(0 < out.sum() < a.group)
            owners += [t] * a.group
            infos += [{"valid": True, "resolved": bool(x)} for x in out]
        sampler.observe(owners, infos)
        m = sampler.metrics()
        active.append(m["pool/active"])
        signal.append(with_signal / a.per_step)
    return active, signal


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=40)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--per-step", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--skill0", type=float, default=-1.0)
    ap.add_argument("--rate", type=float, default=0.1)
    ap.add_argument("--min-active", type=int, default=8)
    ap.add_argument("--per-request", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    S.PROPOSERS["sim"] = S.Proposer(_proposer, Task.model_validate, lambda t: t.model_dump())
    print(f"load at start {os.getloadavg()}")
    results = {name: run(a, name == "synth") for name in ("no synth", "synth")}
    block = max(a.steps // 8, 1)
    print("steps      " + "  ".join(f"{n:>22}" for n in results))
    for b in range(0, a.steps, block):
        cells = [
            f"active {np.mean(x[b : b + block]):5.1f} signal {np.mean(y[b : b + block]):.2f}"
            for x, y in results.values()
        ]
        print(f"{b:3d}-{b + block - 1:3d}    " + "  ".join(f"{c:>22}" for c in cells))
    half = a.steps // 2
    (na, ns), (sa, ss) = results["no synth"], results["synth"]
    print(
        f"last half: active band {np.mean(sa[half:]):.1f} vs {np.mean(na[half:]):.1f}; "
        f"groups with signal {np.mean(ss[half:]):.2f} vs {np.mean(ns[half:]):.2f} "
        f"(ratio {np.mean(ss[half:]) / max(np.mean(ns[half:]), 1e-9):.2f})"
    )
    print(f"load at end {os.getloadavg()}")


if __name__ == "__main__":
    main()
