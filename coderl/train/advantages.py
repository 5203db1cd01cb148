"""Advantages before the trainer step: the only algorithm-specific part of a training step.

``GROUP_ESTIMATORS`` maps ``algorithm.advantage`` to an episode-level estimator: one advantage per
episode, from the episode's outcome and its group's baseline (an episode is one group member
however many segments it has), given to every segment of the episode. ``"gae"`` (PPO) is per
token and needs the value head; it runs over an episode's segments as one sequence, see
:func:`gae_advantages`. ``"vineppo"`` is per turn (values from continuations,
:mod:`coderl.train.branching`), broadcast to each turn's tokens by
:func:`turn_token_advantages`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from coderl import algorithms as A
from coderl.trajectory import Segment


def _grpo(rewards: Tensor, groups: Tensor, valid: Tensor) -> Tensor:
    return A.group_advantages(rewards, groups, valid=valid)


def _dr_grpo(rewards: Tensor, groups: Tensor, valid: Tensor) -> Tensor:
    return A.group_advantages(rewards, groups, valid=valid, std_normalize=False)


def _rloo(rewards: Tensor, groups: Tensor, valid: Tensor) -> Tensor:
    return A.group_advantages(rewards, groups, valid=valid, leave_one_out=True, std_normalize=False)


# algorithm.advantage -> estimator over episodes ([N] rewards, [N] group ids, [N] valid -> [N])
GROUP_ESTIMATORS: dict[str, Callable[[Tensor, Tensor, Tensor], Tensor]] = {
    "grpo": _grpo,
    "dr_grpo": _dr_grpo,
    "rloo": _rloo,
}


def episode_advantages(
    name: str, rewards: list[float], groups: list[int], valid: list[bool]
) -> Tensor:
    """``[N]`` float32 advantages of N episodes (0 for invalid ones).

    GRPO (Shao et al. 2024, Sec. 4.1.2), Dr. GRPO (Liu et al. 2025, Sec. 3.2) and RLOO
    (Ahmadian et al. 2024, Eq. 6), all from :func:`coderl.algorithms.group_advantages`.

    Raises:
        ValueError: unknown estimator (lists the valid ones).
    """
    if name not in GROUP_ESTIMATORS:
        raise ValueError(f"unknown group advantage {name!r}; valid: {sorted(GROUP_ESTIMATORS)}")
    r = torch.tensor([x if v else 0.0 for x, v in zip(rewards, valid, strict=True)])
    return GROUP_ESTIMATORS[name](r, torch.tensor(groups), torch.tensor(valid))


def outcome_token_rewards(mask: Tensor, rewards: Tensor) -> Tensor:
    """``[B, T]`` per-token rewards: each row's scalar reward on its last sampled token.

    Args:
        mask: ``[B, T]`` bool, sampled tokens.
        rewards: ``[B]`` float, the outcome reward of each row's episode.
    """
    T = mask.shape[1]
    pos = torch.arange(T, device=mask.device).expand_as(mask)
    last = torch.where(mask, pos, torch.full_like(pos, -1)).max(dim=1).values  # (B,)
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    rows = (last >= 0).nonzero().squeeze(1)
    out[rows, last[rows]] = rewards[rows].float()
    return out


def gae_advantages(
    rewards: Tensor, values: Tensor, mask: Tensor, episodes: Tensor, *, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """PPO advantages: GAE over each episode's segments together
    (:func:`coderl.algorithms.episode_gae`, Schulman et al. 2016, Eq. 16) on the outcome reward
    placed on the episode's last sampled token, then whitened over the batch's sampled tokens
    (the PPO implementation detail of Huang et al. 2022, "The 37 Implementation Details of
    PPO", #7). A segment that ends in a self-summary is not terminal: its last token bootstraps
    from the next segment's first value, so the windows before a summary get the outcome's
    credit, discounted per token.

    Args:
        rewards: ``[B]`` the outcome reward of each row's episode (read on the episode's last
            row that has a sampled token); values: ``[B, T]`` value predictions;
            mask: ``[B, T]``; episodes: ``[B]`` integer episode of each row, rows of an
            episode in segment order.

    Returns:
        ``(advantages [B, T], returns [B, T])``, 0 where ``mask`` is 0.
    """
    m = mask.bool()
    has = m.any(dim=1)  # (B,)
    rows = torch.arange(m.shape[0], device=m.device)
    last = torch.zeros_like(has)  # (B,) the row that holds its episode's last sampled token
    for e in torch.unique(episodes[has]):
        last[rows[has & (episodes == e)].max()] = True
    token_rewards = outcome_token_rewards(mask, torch.where(last, rewards, 0.0))
    adv, ret = A.episode_gae(token_rewards, values, mask, episodes, gamma=gamma, lam=lam)
    if int(m.sum()) > 1:
        mean, std = adv[m].mean(), adv[m].std()
        adv = torch.where(m, (adv - mean) / (std + 1e-8), torch.zeros_like(adv))
    return adv, ret


def turn_token_advantages(segment: Segment, turn_adv: Sequence[float]) -> list[float]:
    """One segment's per-token advantages from its episode's per-turn ones (``vineppo``).

    Each sampled action span gets the advantage of the turn it belongs to (the ``turn`` that
    :mod:`coderl.agent.episode` records per action in ``provenance["actions"]``; a
    self-summary counts with the turn after it, a summary after the last turn with the last);
    prompts, tool outputs and template scaffolding (``loss_mask`` 0) get 0.

    Args:
        segment: a context window of the episode (its ``spans`` and ``actions`` provenance).
        turn_adv: ``[n]`` the episode's advantage per turn, ``n >= 1`` turns.

    Returns:
        ``len(segment)`` floats.

    Raises:
        ValueError: no turns, or the segment's action spans and records disagree.
    """
    if not turn_adv:
        raise ValueError("an episode with sampled tokens needs at least one turn's advantage")
    spans = [(s, e) for kind, s, e in segment.provenance.get("spans", []) if kind == "action"]
    actions = segment.provenance.get("actions", [])
    if len(spans) != len(actions) or any("turn" not in a for a in actions):
        raise ValueError(f"{len(spans)} action spans but {len(actions)} turn-tagged actions")
    out = [0.0] * len(segment)
    for (start, end), action in zip(spans, actions, strict=True):
        a = float(turn_adv[min(int(action["turn"]), len(turn_adv) - 1)])
        for t in range(start, end):
            out[t] = a * segment.loss_mask[t]
    return out
