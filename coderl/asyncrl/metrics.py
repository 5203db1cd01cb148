"""Metrics of an asynchronous run: staleness histograms (per group and per sampled token), dropped
and re-sampled groups, trainer and rollout idle fractions, sampler/trainer logprob gap,
trajectories/s and optimizer steps/hour."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from coderl.algorithms import logprob_gap
from coderl.asyncrl.types import Group

# the gap is the package's one (coderl.algorithms)
__all__ = ["AsyncMetrics", "hist_mean", "logprob_gap", "token_staleness"]


@dataclass
class AsyncMetrics:
    """Counters of one run segment; :meth:`summary` turns them into rates and fractions."""

    num_workers: int = 1
    staleness: Counter[int] = field(default_factory=Counter)
    """Trained groups by staleness ``version_at_train - oldest_version_in_group``."""
    token_staleness: Counter[int] = field(default_factory=Counter)
    """Trained sampled tokens by staleness ``version_at_train - version_that_sampled_it``
    (with in-flight weight updates one episode's tokens have several)."""
    stale_staleness: Counter[int] = field(default_factory=Counter)
    """Groups evicted as too stale, by staleness."""
    dropped_groups: int = 0
    resampled_groups: int = 0
    steps: int = 0
    trajectories_generated: int = 0
    trajectories_trained: int = 0
    trainer_wait_s: float = 0.0
    """Seconds the trainer spent waiting for a complete, admissible batch."""
    train_s: float = 0.0
    """Seconds spent inside optimizer steps."""
    rollout_busy_s: float = 0.0
    """Worker-seconds spent on groups that came back (in-flight work is not counted yet)."""
    logprob_gaps: list[float] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    def summary(self) -> dict[str, Any]:
        """Rates and fractions of the segment. What it did not measure is absent, not 0: the
        staleness means and ``token_staleness_max`` without a trained group or token, the
        ``logprob_gap`` without a step that computed one (no step updated the policy)."""
        wall = max(time.monotonic() - self.started, 1e-9)
        out: dict[str, Any] = {
            "wall_s": wall,
            "steps": self.steps,
            "trajectories_per_s": self.trajectories_trained / wall,
            "generated_trajectories_per_s": self.trajectories_generated / wall,
            "optimizer_steps_per_hour": self.steps * 3600.0 / wall,
            "trainer_idle_fraction": self.trainer_wait_s / wall,
            "rollout_idle_fraction": max(
                0.0, 1.0 - self.rollout_busy_s / (self.num_workers * wall)
            ),
            "dropped_groups": self.dropped_groups,
            "resampled_groups": self.resampled_groups,
            "staleness_hist": dict(sorted(self.staleness.items())),
        }
        if self.staleness:
            out["mean_staleness"] = hist_mean(self.staleness)
        if self.token_staleness:
            out["token_staleness_mean"] = hist_mean(self.token_staleness)
            out["token_staleness_max"] = max(self.token_staleness)
        if self.logprob_gaps:
            out["logprob_gap"] = sum(self.logprob_gaps) / len(self.logprob_gaps)
        return out


def hist_mean(hist: Counter[int]) -> float:
    """Mean of a histogram ``{value: count}`` (0.0 when empty)."""
    return sum(k * n for k, n in hist.items()) / max(1, sum(hist.values()))


def token_staleness(groups: list[Group], version: int) -> Counter[int]:
    """Sampled tokens of ``groups`` by staleness ``version - token_version`` (trained at
    ``version``), the per-token counterpart of the per-group ``version - oldest_version``."""
    return Counter(version - v for g in groups for ep in g.episodes for v in ep.sampled_versions())
