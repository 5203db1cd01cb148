"""Metrics of an asynchronous run: staleness histogram, dropped and re-sampled groups, trainer and
rollout idle fractions, sampler/trainer logprob gap, trajectories/s and optimizer steps/hour."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor


def logprob_gap(train_logp: Tensor, behavior_logp: Tensor, mask: Tensor) -> dict[str, float]:
    """How far the trainer's logprobs are from the sampler's on the sampled tokens.

    Returns ``logprob_gap`` = mean ``|train_logp - behavior_logp|`` and ``logprob_gap_kl`` = mean
    k3 estimate of KL(behaviour || trainer), ``exp(d) - 1 - d`` with ``d = train - behaviour``
    (Schulman 2020, "Approximating KL Divergence"), both over tokens where ``mask`` is 1 (0 when
    there are none). Staleness and sampler/trainer numerics both widen it.

    Args:
        train_logp, behavior_logp: ``[B, T]`` float logprobs of the same sampled tokens.
        mask: ``[B, T]`` bool or 0/1.

    Raises:
        ValueError: shapes differ.
    """
    if not (train_logp.shape == behavior_logp.shape == mask.shape):
        raise ValueError(
            f"shape mismatch: train {tuple(train_logp.shape)}, behaviour "
            f"{tuple(behavior_logp.shape)}, mask {tuple(mask.shape)}"
        )
    with torch.no_grad():
        m = mask.to(torch.bool)
        d = (train_logp.double() - behavior_logp.double())[m]  # (N,)
        if d.numel() == 0:
            return {"logprob_gap": 0.0, "logprob_gap_kl": 0.0}
        return {
            "logprob_gap": float(d.abs().mean()),
            "logprob_gap_kl": float((d.clamp(max=20).exp() - 1 - d).mean()),
        }


@dataclass
class AsyncMetrics:
    """Counters of one run segment; :meth:`summary` turns them into rates and fractions."""

    num_workers: int = 1
    staleness: Counter[int] = field(default_factory=Counter)
    """Trained groups by staleness ``version_at_train - oldest_version_in_group``."""
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
        wall = max(time.monotonic() - self.started, 1e-9)
        return {
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
            "mean_staleness": (
                sum(k * n for k, n in self.staleness.items()) / max(1, sum(self.staleness.values()))
            ),
            "logprob_gap": sum(self.logprob_gaps) / len(self.logprob_gaps)
            if self.logprob_gaps
            else 0.0,
        }
