"""Advantages from single samples: production gives one completion per context.

Group-normalised advantages (GRPO, Dr. GRPO, RLOO) compare several samples of the *same* prompt;
with one sample per context every group has size 1, the group mean equals the reward and every
advantage is 0 (or undefined after std-normalisation). Such a config is rejected with that
explanation. Baselines that work on single samples:

- ``batch-norm``: ``A_i = (r_i - mean(r)) / (std(r) + eps)`` over the batch (a batch-mean
  REINFORCE baseline, Williams 1992, "Simple statistical gradient-following algorithms",
  Sec. 4; global batch normalisation as in REINFORCE++, Hu 2025, Sec. 3.2).
- ``running-segment``: ``A_i = r_i - b_s`` with ``b_s`` an exponential moving average of the
  rewards of segment ``s`` (the population), updated after use,
  ``b_s <- (1 - alpha) * b_s + alpha * r`` (reinforcement baseline, Williams 1992, Sec. 4;
  Sutton & Barto 2018, Sec. 13.4). The first reward of an unseen segment gets advantage 0.

State (the running baselines) is passed in and returned; the cycle reads and writes it in the
store. Not implemented: a learned value baseline (needs a value head on the policy).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor

from coderl.config.online import BASELINE_NAMES, check_baseline

BaselineState = dict[str, tuple[float, int]]
"""Segment -> ``(running baseline value, rewards seen)``; an unseen segment is ``(0.0, 0)``."""


def batch_norm(
    rewards: Tensor,
    segments: Sequence[str],
    state: Mapping[str, tuple[float, int]],
    *,
    alpha: float,
) -> tuple[Tensor, BaselineState]:
    """``[B]`` float32 rewards -> ``[B]`` advantages ``(r - mean) / (std + 1e-6)``; the state is
    returned unchanged (this baseline keeps none).

    Raises:
        ValueError: fewer than 2 rewards.
    """
    if rewards.numel() < 2:
        raise ValueError("batch-norm baseline needs a batch of at least 2 rewards")
    return (rewards - rewards.mean()) / (rewards.std(unbiased=False) + 1e-6), dict(state)


def running_segment(
    rewards: Tensor,
    segments: Sequence[str],
    state: Mapping[str, tuple[float, int]],
    *,
    alpha: float,
) -> tuple[Tensor, BaselineState]:
    """``[B]`` rewards -> ``([B]`` advantages ``r - b_segment``, the updated state).

    Within a batch each reward is compared to the baseline *before* this batch's updates of its
    segment, so the order of rows does not change the advantages. ``state`` is not modified;
    segments missing from it are unseen.

    Raises:
        ValueError: ``alpha`` outside (0, 1].
    """
    if not 0 < alpha <= 1:
        raise ValueError(f"alpha must be in (0, 1], got {alpha}")
    adv = torch.zeros_like(rewards)
    new = dict(state)
    for i, s in enumerate(segments):
        value, n = state.get(s, (0.0, 0))
        adv[i] = rewards[i] - value if n > 0 else 0.0
        v, k = new.get(s, (0.0, 0))
        r = float(rewards[i])
        new[s] = (r, 1) if k == 0 else ((1 - alpha) * v + alpha * r, k + 1)
    return adv, new


BASELINES: dict[str, Callable[..., tuple[Tensor, BaselineState]]] = {
    "batch-norm": batch_norm,
    "running-segment": running_segment,
}
"""Baseline name -> pure function ``(rewards, segments, state, alpha) -> (advantages, state)``."""


if set(BASELINES) != set(BASELINE_NAMES):  # the config's names and these functions agree
    raise ImportError(f"BASELINES {sorted(BASELINES)} != {sorted(BASELINE_NAMES)}")


def advantages(
    name: str,
    rewards: Tensor,
    segments: Sequence[str],
    state: Mapping[str, tuple[float, int]],
    *,
    alpha: float = 0.1,
) -> tuple[Tensor, BaselineState]:
    """Single-sample advantages ``[B]`` float32 for rewards ``[B]`` (see module docstring), and
    the baseline state after this batch. Pure: the caller loads ``state`` (e.g. from the store)
    and saves the returned one.

    Raises:
        ValueError: see :func:`coderl.config.online.check_baseline`; ``len(segments) != B``.
    """
    check_baseline(name)
    if len(segments) != rewards.numel():
        raise ValueError(f"{len(segments)} segments for {rewards.numel()} rewards")
    return BASELINES[name](rewards.float(), segments, state, alpha=alpha)
