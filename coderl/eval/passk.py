"""Held-out evaluation: pass@k (unbiased) and best-of-n over a task split, with 95% confidence
intervals from a bootstrap over tasks.

Confidence intervals: the percentile bootstrap (Efron & Tibshirani 1993, "An Introduction to the
Bootstrap", Ch. 13) resampling *tasks* with replacement, 2000 resamples, fixed seed. Samples of
one task are correlated, so the task is the unit. Before/after comparisons use the paired
bootstrap of per-task differences (:func:`paired_difference`), which is what decides whether an
improvement excludes zero.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from coderl import algorithms as A
from coderl.policy.base import SamplingParams

BOOTSTRAP_RESAMPLES = 2000


def bootstrap_ci(values: list[float], *, level: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Percentile-bootstrap CI of the mean of ``values`` (one value per task).

    Raises:
        ValueError: no values, or ``level`` outside (0, 1).
    """
    if not values:
        raise ValueError("bootstrap_ci needs at least one value")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    x = np.asarray(values, dtype=np.float64)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(x), size=(BOOTSTRAP_RESAMPLES, len(x)))
    means = x[idx].mean(axis=1)
    alpha = (1 - level) / 2
    return float(np.quantile(means, alpha)), float(np.quantile(means, 1 - alpha))


@dataclass
class Estimate:
    mean: float
    lo: float
    """Lower end of the 95% CI."""
    hi: float
    """Upper end of the 95% CI."""


def estimate(values: list[float], seed: int = 0) -> Estimate:
    lo, hi = bootstrap_ci(values, seed=seed)
    return Estimate(float(np.mean(values)), lo, hi)


def paired_difference(before: list[float], after: list[float], seed: int = 0) -> Estimate:
    """Mean of per-task ``after - before`` with its paired-bootstrap 95% CI.

    Raises:
        ValueError: the lists differ in length or are empty.
    """
    if len(before) != len(after) or not before:
        raise ValueError(f"paired lists must be equal and non-empty: {len(before)} vs {len(after)}")
    return estimate([a - b for a, b in zip(after, before, strict=True)], seed)


@dataclass
class EvalResult:
    """Evaluation of one policy on one task split."""

    samples: int
    """n: samples per task."""
    pass_at: dict[str, Estimate] = field(default_factory=dict)
    """``"1"``, ``"16"``... -> unbiased pass@k (Chen et al. 2021, Eq. 1) over tasks with CI."""
    best_of_n: Estimate | None = None
    """Mean over tasks of the best ``fraction_passed`` among the n samples."""
    per_task: list[dict[str, Any]] = field(default_factory=list)
    """``{"task_id", "n", "correct", "best"}`` per task (for paired comparisons)."""
    grading_errors: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(
    per_task: list[dict[str, Any]], ks: list[int], samples: int, grading_errors: int = 0
) -> EvalResult:
    """pass@k for each k and best-of-n from per-task ``n``/``correct``/``best`` counts.

    Raises:
        ValueError: no tasks, or a k larger than a task's n.
    """
    if not per_task:
        raise ValueError("no tasks to summarize")
    res = EvalResult(samples=samples, per_task=per_task, grading_errors=grading_errors)
    for k in ks:
        vals = [A.pass_at_k(t["n"], t["correct"], k) for t in per_task]
        res.pass_at[str(k)] = estimate(vals)
    res.best_of_n = estimate([float(t["best"]) for t in per_task])
    return res


def evaluate(
    env: Any,
    policy: Any,
    tasks: list[Any],
    *,
    samples: int,
    ks: list[int],
    params: SamplingParams,
    tasks_per_batch: int = 4,
) -> EvalResult:
    """Sample ``samples`` episodes per task with ``env.rollout``, grade them, and summarize.

    Episodes whose grading failed count as incorrect (and are counted in ``grading_errors``): an
    evaluation must not look better because the grader broke.

    Args:
        env: a :class:`coderl.envs.Environment`.
        policy: what ``env.rollout`` samples from.
        tasks: the split to evaluate.
        samples: n per task; ks: the k values (each <= n); params: sampling parameters (its seed
            is offset per batch of tasks so results do not depend on batching order).
        tasks_per_batch: tasks rolled out together.
    """
    per_task: list[dict[str, Any]] = []
    errors = 0
    for start in range(0, len(tasks), tasks_per_batch):
        chunk = tasks[start : start + tasks_per_batch]
        seed = None if params.seed is None else params.seed + start
        episodes = env.rollout(policy, chunk, replace(params, seed=seed), samples)
        owners = [t for t in chunk for _ in range(samples)]
        grades = env.grade(owners, episodes)
        for i, task in enumerate(chunk):
            g = grades[i * samples : (i + 1) * samples]
            errors += sum(x.grading_error is not None for x in g)
            ok = [x.resolved and x.grading_error is None for x in g]
            best = max((x.fraction_passed if x.grading_error is None else 0.0) for x in g)
            per_task.append({"task_id": task.id, "n": samples, "correct": sum(ok), "best": best})
    return summarize(per_task, ks, samples, errors)
