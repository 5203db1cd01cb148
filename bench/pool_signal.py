"""Groups with signal under ``tasks.sampler=uniform`` vs ``pool``, on simulated tasks (no model).

Each simulated task has a fixed true pass rate: ``--unsolvable`` of them 0, a share
``--solved`` of the rest 1, the others uniform in [0.05, 0.6] (a policy that is weak on most
tasks). A group is ``--group`` Bernoulli outcomes of its task; a group has signal when its
outcomes are not all equal (what ``signal/groups_with_signal`` logs). The policy does not learn,
so this measures only the sampler's calibration, not a training gain; the distinct tasks drawn
show how much of the split each sampler covers.

    .venv/bin/python bench/pool_signal.py
    .venv/bin/python bench/pool_signal.py --tasks 500 --steps 200 --group 16
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import numpy as np

from coderl.config import PoolConfig
from coderl.train.sampling import PoolSampler, TaskSampler


@dataclass
class _Task:
    id: str


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=164)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--per-step", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--unsolvable", type=float, default=0.5)
    ap.add_argument("--solved", type=float, default=0.3)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rng = np.random.default_rng(a.seed)
    zero = rng.random(a.tasks) < a.unsolvable
    one = rng.random(a.tasks) < a.solved
    p = np.where(zero, 0.0, np.where(one, 1.0, rng.uniform(0.05, 0.6, a.tasks)))
    tasks = [_Task(f"t{i}") for i in range(a.tasks)]
    print(f"{a.tasks} tasks, share with 0 < p < 1: {((p > 0) & (p < 1)).mean():.2f}")
    for name in ("uniform", "pool"):
        sampler = (
            TaskSampler(tasks, a.seed)
            if name == "uniform"
            else PoolSampler(tasks, a.seed, PoolConfig(), a.per_step)
        )
        draws = np.random.default_rng(a.seed + 1)
        signal, seen = [], set()
        for _ in range(a.steps):
            owners, infos = [], []
            for _, t in sampler.take(a.per_step):
                out = draws.random(a.group) < p[int(t.id[1:])]
                signal.append(0 < out.sum() < a.group)
                seen.add(t.id)
                owners += [t] * a.group
                infos += [{"valid": True, "resolved": bool(o)} for o in out]
            sampler.observe(owners, infos)
        s = np.array(signal, dtype=float).reshape(a.steps, a.per_step).mean(1)
        first = max(1, a.steps // 5)
        print(
            f"{name:8s} groups with signal: first {first} steps {s[:first].mean():.2f}, "
            f"rest {s[first:].mean():.2f}; distinct tasks drawn {len(seen)}"
        )


if __name__ == "__main__":
    main()
