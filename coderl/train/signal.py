"""What the rolled-out groups say about the task pool: the per-step ``signal/*`` metrics with the
sampler's ``pool/*`` and ``mix/*`` (:func:`rollout_metrics`), and the pool's pre-pass over the
training tasks before the first step (:func:`prepass`). The samplers themselves are
:mod:`coderl.train.sampling`.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from coderl.rewards import RewardResult
from coderl.train import pipeline as P
from coderl.train.sampling import MixSampler, TaskSource

PREPASS_UNIT = 50_000_000
"""Rollout unit of pre-pass chunk ``c`` is ``PREPASS_UNIT + c`` (no training step reaches it)."""


def _mean(xs: list[float]) -> float:
    return float(np.mean(xs)) if xs else math.nan


def rollout_metrics(
    sampler: TaskSource, tasks: list[Any], keys: list[str], infos: list[dict[str, Any]]
) -> dict[str, float]:
    """Metrics of a step's rolled-out episodes (``tasks``, ``keys``, ``infos``: per episode,
    every round, before any dynamic-sampling drop) and of the sampler's state.

    ``signal/groups`` (groups rolled out), ``signal/groups_with_signal`` (share of them whose
    valid rewards are not all equal, :func:`coderl.train.pipeline.zero_variance_groups`);
    for a mix, ``mix/<label>/tasks`` (groups), ``mix/<label>/reward_mean`` and
    ``mix/<label>/resolved`` (over valid episodes; NaN without one); then
    :meth:`TaskSource.metrics`.
    """
    rewards = RewardResult([x["total"] for x in infos], [x["valid"] for x in infos], [])
    groups = set(keys)
    flat = P.zero_variance_groups(keys, rewards) if groups else set()
    m = {
        "signal/groups": float(len(groups)),
        "signal/groups_with_signal": (len(groups) - len(flat)) / len(groups)
        if groups
        else math.nan,
    }
    labels: dict[str, list[int]] = {}
    for i, t in enumerate(tasks):
        label = sampler.source_of(t)
        if label is not None:
            labels.setdefault(label, []).append(i)
    if isinstance(sampler, MixSampler):
        for label in sampler.labels:
            idx = labels.get(label, [])
            valid = [infos[i] for i in idx if infos[i]["valid"]]
            m[f"mix/{label}/tasks"] = float(len({keys[i] for i in idx}))
            m[f"mix/{label}/reward_mean"] = _mean([x["total"] for x in valid])
            m[f"mix/{label}/resolved"] = _mean([float(x["resolved"]) for x in valid])
    m.update(sampler.metrics())
    return m


def prepass(run: Any) -> int:
    """Seed the sampler's estimates before the first step: ``tasks.pool.prepass_samples``
    episodes of each of :meth:`TaskSource.prepass_tasks`, rolled out ``tasks_per_step`` tasks at
    a time (chunk ``c`` seeded ``rollout_seed(seed, PREPASS_UNIT + c)``), graded and observed,
    never trained on. Returns the episodes rolled out (0: no pre-pass configured)."""
    cfg, n = run.cfg, run.cfg.tasks.pool.prepass_samples
    tasks = run.sampler.prepass_tasks() if n > 0 else []
    per = cfg.tasks.tasks_per_step
    for c in range(0, len(tasks), per):
        chunk = tasks[c : c + per]
        params = P.sampling_params(cfg, P.rollout_seed(cfg.seed, PREPASS_UNIT + c // per))
        episodes = run.env.rollout(run.engine or run.policy, chunk, params, n)
        owners = [t for t in chunk for _ in range(n)]
        keys = [P.group_key(t.id, -1 - c - j) for j, t in enumerate(chunk) for _ in range(n)]
        scored = P.score(run.env, run.policy, cfg, owners, keys, episodes)
        run.sampler.observe(owners, scored.infos)
    run.sampler.metrics()  # the pre-pass draws nothing; start the step counters clean
    return int(len(tasks) * n)
