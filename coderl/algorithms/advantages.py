"""Advantage estimators: group baselines (GRPO, Dr. GRPO, RLOO) and GAE for PPO.

Pure functions on tensors: no state, no config objects, no I/O.
"""

from __future__ import annotations

import torch
from torch import Tensor


def group_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    *,
    std_normalize: bool = True,
    leave_one_out: bool = False,
    valid: Tensor | None = None,
    eps: float = 1e-6,
) -> Tensor:
    """Outcome advantages with a per-group baseline.

    Rows belong to the same group when their ``group_ids`` are equal, wherever they sit in the
    batch. For the valid rows ``i`` of a group with ``n`` valid rows and rewards ``r``:

    - GRPO (Shao et al. 2024, DeepSeekMath, Sec. 4.1.2, outcome supervision):
      ``A_i = (r_i - mean(r)) / (std(r) + eps)`` with the unbiased (n - 1) standard deviation.
    - Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training", Sec. 3.2, Eq. 3),
      ``std_normalize=False``: ``A_i = r_i - mean(r)``.
    - RLOO (Ahmadian et al. 2024, "Back to Basics", Eq. 6; Kool et al. 2019),
      ``leave_one_out=True``: ``A_i = r_i - (sum(r) - r_i) / (n - 1)``; with ``std_normalize``
      it is further divided by ``std(r) + eps``.

    Invalid rows (``valid=False``: rejected, errored, grading failures) contribute nothing to any
    group statistic and get advantage 0, whatever their reward holds (NaN included). A group whose
    valid rewards are all equal, or that has fewer than two valid rows, gets exactly 0.

    Args:
        rewards: ``[B]`` float rewards, one per trajectory.
        group_ids: ``[B]`` integer group labels (e.g. the task index); any values, any order.
        std_normalize: divide by the group's standard deviation (GRPO); False is Dr. GRPO.
        leave_one_out: use the mean of the *other* rows as baseline (RLOO).
        valid: ``[B]`` bool; None means every row is valid.
        eps: added to the standard deviation before dividing.

    Returns:
        ``[B]`` advantages, same dtype as ``rewards``. Each group's advantages sum to zero
        (up to rounding).

    Raises:
        ValueError: shapes differ or are not 1-D, or a valid row holds a non-finite reward
            (the message names the row).
    """
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            f"rewards and group_ids must both be [B]; got {tuple(rewards.shape)} and "
            f"{tuple(group_ids.shape)}"
        )
    if valid is None:
        valid = torch.ones_like(rewards, dtype=torch.bool)
    elif valid.shape != rewards.shape:
        raise ValueError(f"valid must be [B]={tuple(rewards.shape)}, got {tuple(valid.shape)}")
    valid = valid.to(torch.bool)
    bad = valid & ~torch.isfinite(rewards)
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"non-finite reward {rewards[row].item()} in valid row {row} (group "
            f"{group_ids[row].item()}); mark the row invalid or fix the reward"
        )

    advantages = torch.zeros_like(rewards)
    for gid in torch.unique(group_ids[valid]):
        rows = ((group_ids == gid) & valid).nonzero().squeeze(1)  # (n,)
        r = rewards[rows]  # (n,)
        n = r.numel()
        if n < 2 or bool((r == r[0]).all()):
            continue  # no signal: exactly 0, never NaN
        if leave_one_out:
            baseline = (r.sum() - r) / (n - 1)  # (n,)
        else:
            baseline = r.mean()
        adv = r - baseline
        if std_normalize:
            adv = adv / (r.std(unbiased=True) + eps)
        advantages[rows] = adv
    return advantages


def gae(
    rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    *,
    gamma: float,
    lam: float,
) -> tuple[Tensor, Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016, "High-Dimensional Continuous
    Control Using GAE", Eq. 16) over the trainable tokens of each row.

    ``delta_t = r_t + gamma * V(s_{t+1}) - V(s_t)``; ``A_t = sum_l (gamma * lam)^l delta_{t+l}``;
    ``returns_t = A_t + V(s_t)``. The recursion runs over positions with ``mask=1`` only: masked
    positions (padding, or tool observations between agent turns) are skipped, so the next state of
    the last trainable token of a turn is the first trainable token of the next turn. After the last
    trainable token the episode ends (bootstrap value 0): a row is an episode; for episodes over
    several rows (context windows) see :func:`episode_gae`.

    Args:
        rewards: ``[B, T]`` float per-token rewards (typically the outcome reward on the last
            trainable token, plus any per-token KL-in-reward).
        values: ``[B, T]`` float value estimates ``V(s_t)``.
        mask: ``[B, T]`` bool or 0/1; 1 on tokens the policy sampled.
        gamma: discount factor in ``[0, 1]``.
        lam: GAE lambda in ``[0, 1]``.

    Returns:
        ``(advantages, returns)``, both ``[B, T]`` in ``values``' dtype, 0 where ``mask`` is 0.

    Raises:
        ValueError: shapes differ.
    """
    if not (rewards.shape == values.shape == mask.shape) or rewards.dim() != 2:
        raise ValueError(
            f"rewards, values and mask must all be [B, T]; got {tuple(rewards.shape)}, "
            f"{tuple(values.shape)}, {tuple(mask.shape)}"
        )
    m = mask.to(values.dtype)
    r = rewards.to(values.dtype)
    B, T = values.shape
    next_value = values.new_zeros(B)  # V of the next trainable state
    last_gae = values.new_zeros(B)
    advantages = torch.zeros_like(values)
    for t in reversed(range(T)):
        delta = r[:, t] + gamma * next_value - values[:, t]
        cur = delta + gamma * lam * last_gae
        # masked positions carry the recursion through unchanged
        last_gae = m[:, t] * cur + (1 - m[:, t]) * last_gae
        next_value = m[:, t] * values[:, t] + (1 - m[:, t]) * next_value
        advantages[:, t] = cur * m[:, t]
    returns = (advantages + values) * m
    return advantages, returns


def episode_gae(
    rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    episode_ids: Tensor,
    *,
    gamma: float,
    lam: float,
) -> tuple[Tensor, Tensor]:
    """GAE (Schulman et al. 2016, Eq. 16) over episodes that span several rows (segments).

    An agent episode that summarises its context is several context windows, one row each
    (:class:`coderl.trajectory.Segment`). For GAE they are one episode: its states are the
    trainable tokens of all its rows in batch order, so with ``s_t`` the episode's t-th trainable
    token over the concatenation of its rows,

    ``delta_t = r_t + gamma * V(s_{t+1}) - V(s_t)``, ``A_t = sum_l (gamma * lam)^l delta_{t+l}``,
    ``returns_t = A_t + V(s_t)``,

    exactly :func:`gae` on that concatenation. At a row boundary the last token of segment ``i``
    (the summary the policy wrote) bootstraps from ``V`` of the first trainable token of segment
    ``i + 1`` and its advantage carries the discounted advantages of what follows: opening a new
    window is a transition of the environment, not the end of the episode. Only after the last
    trainable token of an episode's last row is the state terminal (bootstrap value 0). With one
    row per episode this is :func:`gae`.

    Args:
        rewards: ``[B, T]`` float per-token rewards (e.g. the outcome on the episode's last
            trainable token); entries where ``mask`` is 0 are ignored, as in :func:`gae`.
        values: ``[B, T]`` float value estimates ``V(s_t)``.
        mask: ``[B, T]`` bool or 0/1; 1 on tokens the policy sampled.
        episode_ids: ``[B]`` integer episode of each row; an episode's rows must be in segment
            order (they need not be adjacent).
        gamma: discount factor per token, in ``[0, 1]``.
        lam: GAE lambda in ``[0, 1]``.

    Returns:
        ``(advantages, returns)``, both ``[B, T]`` in ``values``' dtype, 0 where ``mask`` is 0.

    Raises:
        ValueError: ``rewards``, ``values`` and ``mask`` are not all ``[B, T]``, or
            ``episode_ids`` is not ``[B]``.
    """
    if not (rewards.shape == values.shape == mask.shape) or rewards.dim() != 2:
        raise ValueError(
            f"rewards, values and mask must all be [B, T]; got {tuple(rewards.shape)}, "
            f"{tuple(values.shape)}, {tuple(mask.shape)}"
        )
    if episode_ids.shape != (values.shape[0],):
        raise ValueError(
            f"episode_ids must be [B]={values.shape[0]}, got {tuple(episode_ids.shape)}"
        )
    m = mask.to(torch.bool)
    # each episode's trainable positions, rows in batch order, tokens in position order
    members = [(episode_ids == e).nonzero().squeeze(1) for e in torch.unique(episode_ids)]
    picks = [(rows, m[rows]) for rows in members]  # (k,), (k, T)
    length = max([int(sel.sum()) for _, sel in picks], default=0)
    E = len(picks)
    flat_r = values.new_zeros(E, length)  # (E, L): one row per episode, trainable tokens only
    flat_v = values.new_zeros(E, length)
    flat_m = values.new_zeros(E, length)
    for e, (rows, sel) in enumerate(picks):
        n = int(sel.sum())
        flat_r[e, :n] = rewards[rows][sel].to(values.dtype)
        flat_v[e, :n] = values[rows][sel]
        flat_m[e, :n] = 1.0
    flat_a, flat_ret = gae(flat_r, flat_v, flat_m, gamma=gamma, lam=lam)
    advantages, returns = torch.zeros_like(values), torch.zeros_like(values)
    for e, (rows, sel) in enumerate(picks):
        n = int(sel.sum())
        a, g = advantages[rows], returns[rows]  # (k, T) copies
        a[sel], g[sel] = flat_a[e, :n], flat_ret[e, :n]
        advantages[rows], returns[rows] = a, g
    return advantages, returns
