"""Turn-level credit for multi-turn episodes: Monte-Carlo values at turn boundaries (VinePPO),
advantages over turns, and potential-based reward shaping.

An episode of ``n`` turns visits the states ``s_0`` (the prompt) ... ``s_n`` (terminal) at its turn
boundaries: ``s_t`` is the conversation and the workspace after turn ``t``'s tool results.
Per-turn tensors are padded to ``T`` turns (``mask[e, t] = 1`` for ``t < n_e``); per-boundary
tensors have ``T + 1`` columns, column ``n_e`` being the terminal state.

Pure functions on tensors: no state, no config objects, no I/O.
"""

from __future__ import annotations

import torch
from torch import Tensor


def mc_turn_values(returns: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
    """Monte-Carlo value of each turn boundary from ``K`` continuations sampled there.

    VinePPO (Kazemnejad et al. 2024, "VinePPO: Unlocking RL Potential For LLM Reasoning Through
    Refined Credit Assignment", Sec. 4, the MC value estimate): ``V(s_t) = (1/K) sum_k R(tau_k)``
    with ``tau_k`` ``K`` independent continuations of the policy from ``s_t``. Continuations that
    were masked (an infrastructure failure) are left out of the mean.

    Args:
        returns: ``[E, S, K]`` float, the return of continuation ``k`` from boundary ``s`` of
            episode ``e`` (anything where ``valid`` is False, NaN included).
        valid: ``[E, S, K]`` bool, which continuations exist and were scored.

    Returns:
        ``(values [E, S], known [E, S] bool)`` in ``returns``' dtype: the mean of the valid
        continuations, 0 (and ``known`` False) where a boundary has none.

    Raises:
        ValueError: the shapes differ or are not 3-D, or a valid return is not finite.
    """
    if returns.dim() != 3 or valid.shape != returns.shape:
        raise ValueError(
            f"returns and valid must both be [E, S, K]; got {tuple(returns.shape)} and "
            f"{tuple(valid.shape)}"
        )
    v = valid.to(torch.bool)
    if bool((v & ~torch.isfinite(returns)).any()):
        raise ValueError("a valid continuation has a non-finite return")
    r = torch.where(v, returns, torch.zeros_like(returns))
    count = v.sum(-1)  # (E, S)
    values = r.sum(-1) / count.clamp(min=1).to(returns.dtype)  # (E, S)
    return values, count > 0


def turn_advantages(
    values: Tensor,
    known: Tensor,
    rewards: Tensor,
    mask: Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """Per-turn advantages from boundary values: TD residuals, optionally GAE over turns.

    ``delta_t = r_t + gamma V(s_{t+1}) - V(s_t)`` and ``A_t = sum_l (gamma lam)^l delta_{t+l}``
    (GAE, Schulman et al. 2016, "High-Dimensional Continuous Control Using GAE", Eq. 16, with one
    step per turn), with the terminal value ``V(s_n) = 0``. ``lam = 0`` is VinePPO's advantage
    (Kazemnejad et al. 2024, Sec. 4: ``A(s_t, a_t) = r_t + gamma V(s_{t+1}) - V(s_t)`` with MC
    values); with the outcome reward ``R`` on the last turn and ``gamma = 1`` it is
    ``V(s_{t+1}) - V(s_t)``, the last turn's ``R - V(s_{n-1})``; ``lam = 1`` is ``G_t - V(s_t)``.

    A boundary whose value is not ``known`` (no continuation was sampled there) is not a step:
    the turns between two known boundaries ``b < b'`` form one step (a semi-MDP option) with
    reward ``sum_{t=b}^{b'-1} gamma^(t-b) r_t`` and discount ``gamma^(b'-b)``, and each of those
    turns gets that step's advantage.

    Args:
        values: ``[E, T+1]`` float ``V(s_t)``; only ``t < n_e`` is read (the terminal is 0).
        known: ``[E, T+1]`` bool; ``known[e, 0]`` must be True for every episode with a turn.
        rewards: ``[E, T]`` float per-turn rewards (the outcome on the last turn, plus any
            shaping); 0 where ``mask`` is 0.
        mask: ``[E, T]`` bool or 0/1, the turns each episode took (a prefix of each row).
        gamma: discount per turn, in ``[0, 1]``.
        lam: GAE lambda over steps, in ``[0, 1]``.

    Returns:
        ``(advantages [E, T], returns [E, T])`` in ``values``' dtype (``returns = A + V`` of the
        step each turn belongs to), 0 where ``mask`` is 0.

    Raises:
        ValueError: shapes disagree, ``mask`` is not a prefix per row, or an episode's first
            boundary has no value.
    """
    E, T = mask.shape
    if rewards.shape != (E, T) or values.shape != (E, T + 1) or known.shape != (E, T + 1):
        raise ValueError(
            f"need rewards and mask [E, T], values and known [E, T+1]; got rewards "
            f"{tuple(rewards.shape)}, mask {tuple(mask.shape)}, values {tuple(values.shape)}, "
            f"known {tuple(known.shape)}"
        )
    m = mask.to(torch.bool)
    n_turns = m.sum(1)  # (E,)
    if bool((m != (torch.arange(T) < n_turns[:, None])).any()):
        raise ValueError("mask must be a prefix of each row (the turns an episode took)")
    advantages = torch.zeros(E, T, dtype=values.dtype)
    returns = torch.zeros(E, T, dtype=values.dtype)
    for e in range(E):
        n = int(n_turns[e])
        if n == 0:
            continue
        if not bool(known[e, 0]):
            raise ValueError(f"episode {e} has no value at its first boundary s_0")
        bounds = [t for t in range(n) if bool(known[e, t])] + [n]  # step starts, then terminal
        next_v, carry = 0.0, 0.0  # V of the next step's start (terminal: 0), its advantage
        for b, b2 in reversed(list(zip(bounds[:-1], bounds[1:], strict=True))):
            disc = [gamma ** (t - b) for t in range(b, b2)]
            step_r = sum(d * float(rewards[e, t]) for d, t in zip(disc, range(b, b2), strict=True))
            step_gamma = gamma ** (b2 - b)
            delta = step_r + step_gamma * next_v - float(values[e, b])
            carry = delta + step_gamma * lam * carry
            advantages[e, b:b2] = carry
            returns[e, b:b2] = carry + float(values[e, b])
            next_v = float(values[e, b])
    return advantages, returns


def potential_shaping(potentials: Tensor, mask: Tensor, *, gamma: float = 1.0) -> Tensor:
    """Per-turn shaping rewards ``F_t = gamma Phi(s_{t+1}) - Phi(s_t)``.

    Potential-based shaping (Ng, Harada & Russell 1999, "Policy invariance under reward
    transformations: theory and application to reward shaping", Theorem 1): adding ``F`` to the
    rewards leaves the optimal policies unchanged. The terminal state's potential is 0 (the
    absorbing state of an episodic task, as the theorem's proof needs), so over a whole episode
    the sum telescopes: ``sum_t gamma^t F_t = -Phi(s_0)``, and the shaped return is
    ``G - Phi(s_0)``: complete episodes of one task keep their order, only the credit between
    turns moves.

    Args:
        potentials: ``[E, T+1]`` float ``Phi(s_t)``; column ``n_e`` (the terminal) and later are
            ignored (taken as 0).
        mask: ``[E, T]`` bool or 0/1, the turns each episode took (a prefix of each row).
        gamma: discount per turn, in ``[0, 1]``.

    Returns:
        ``[E, T]`` shaping rewards in ``potentials``' dtype, 0 where ``mask`` is 0.

    Raises:
        ValueError: ``potentials`` is not ``[E, T+1]`` for ``mask`` ``[E, T]``.
    """
    E, T = mask.shape
    if potentials.shape != (E, T + 1):
        raise ValueError(
            f"potentials must be [E, T+1]={(E, T + 1)} for mask {tuple(mask.shape)}, got "
            f"{tuple(potentials.shape)}"
        )
    m = mask.to(potentials.dtype)  # (E, T)
    # Phi of the next boundary; a boundary after the last turn is terminal (potential 0)
    nxt = potentials[:, 1:] * torch.cat([m[:, 1:], torch.zeros(E, 1, dtype=m.dtype)], dim=1)
    return (gamma * nxt - potentials[:, :-1]) * m
