"""``algorithm.advantage: vineppo``: per-turn credit for multi-turn agents from branched rollouts.

Each training episode forks ``rollout.branch.k`` continuations at its chosen turn boundaries
(:mod:`coderl.agent.episode`); :func:`turn_credit` grades and rewards them like any episode
(:func:`coderl.train.pipeline.score`: the same hidden-test graders, the same reward terms and
masks), and turns their returns into each episode's per-turn advantages::

    V(s_0) = mean reward of the other valid episodes of its group    # G - 1 rollouts from s_0
    V(s_t) = mean reward of the valid continuations forked at s_t    # mc_turn_values (VinePPO)
    r_t    = outcome on the last turn + reward.shaping * F_t          # F: potential_shaping
    A_t    = turn_advantages(V, r; gamma, algorithm.turn_lam)         # lam 0: r_t + gamma V(s_{t+1}) - V(s_t)

VinePPO: Kazemnejad et al. 2024, Sec. 4 (MC values from continuations of the policy, the TD
advantage ``r + gamma V(s') - V(s)``). A boundary with no valid continuation (not branched, or
all masked) is no step of its own: the turns up to the next known boundary share one advantage
(:func:`coderl.algorithms.turn_advantages`). An episode whose group has no other valid member
has no ``V(s_0)`` and gets advantage 0 on every turn (as a singleton group does under GRPO).
Continuations are never trained on; they only value states.

Shaping (``reward.shaping > 0``, Ng et al. 1999): ``F_t = gamma Phi(s_{t+1}) - Phi(s_t)`` with
``Phi`` the visible tests' progress (:mod:`coderl.rewards.shaping`: for function repair measured
by the harness with the task's shown check after each ``run``, for repository tasks read from the
runs' pytest output) and the terminal potential pinned to 0, so an episode's shaped return is its
outcome less ``Phi(s_0) = 0``: complete episodes keep their order and a faked test report cannot
add to a return. The values
stay Monte-Carlo estimates of the unshaped return, so a turn's advantage gains ``F_t``.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from coderl import algorithms as A
from coderl.config import Config
from coderl.envs.base import Environment, EpisodeRecord
from coderl.rewards.shaping import visible_potentials
from coderl.tasks.holdout import visible_fail_to_pass
from coderl.train import pipeline as P


def branch_returns(
    env: Environment, policy: Any, cfg: Config, scored: P.Scored
) -> tuple[list[dict[int, list[float | None]]], dict[str, float]]:
    """Grade and reward every continuation of ``scored``'s episodes (one :func:`P.score` call).

    Returns:
        per episode ``{t: [reward or None (masked) per continuation]}``, and metrics:
        ``branch/continuations`` (count), ``branch/masked_rate``, ``time/branch_grading`` (s).
    """
    owners, tasks, keys, records = [], [], [], []
    for i, ep in enumerate(scored.episodes):
        for t, rec in ep.branches:
            owners.append((i, t))
            tasks.append(scored.tasks[i])
            keys.append(scored.keys[i])
            records.append(rec)
    out: list[dict[int, list[float | None]]] = [{} for _ in scored.episodes]
    m = {"branch/continuations": float(len(records)), "branch/masked_rate": 0.0}
    t0 = time.perf_counter()
    if records:
        sc = P.score(env, policy, cfg, tasks, keys, records)
        for (i, t), total, ok in zip(owners, sc.rewards.totals, sc.rewards.valid, strict=True):
            out[i].setdefault(t, []).append(float(total) if ok else None)
        m["branch/masked_rate"] = 1.0 - sum(sc.rewards.valid) / len(records)
    m["time/branch_grading"] = time.perf_counter() - t0
    return out, m


def turn_credit(
    env: Environment, policy: Any, cfg: Config, scored: P.Scored
) -> tuple[list[list[float]], dict[str, float]]:
    """Per episode, its per-turn advantages (see the module docstring), and metrics
    (:func:`branch_returns`'s, plus ``branch/value_s0`` and ``branch/value_known_rate``: the
    share of the episodes' non-terminal boundaries with a value)."""
    returns, m = branch_returns(env, policy, cfg, scored)
    totals, valid, keys = scored.rewards.totals, scored.rewards.valid, scored.keys
    out, known_n, known_d = [], 0, 0
    for i, ep in enumerate(scored.episodes):
        others = [totals[j] for j in range(len(keys)) if j != i and valid[j] and keys[j] == keys[i]]
        n = ep.turns
        if not valid[i] or n < 1 or not others:
            out.append([0.0] * max(n, 1))
            continue
        v0 = sum(others) / len(others)
        phi = potentials_of(cfg, ep, scored.tasks[i] if scored.tasks else None)
        adv, known = episode_turn_advantages(
            totals[i], v0, returns[i], n, phi, gamma=cfg.algorithm.gamma, lam=cfg.algorithm.turn_lam,
            shaping=cfg.reward.shaping,
        )  # fmt: skip
        out.append(adv)
        known_n += known - 1
        known_d += n - 1
    m["branch/value_known_rate"] = known_n / known_d if known_d else math.nan
    return out, m


def episode_turn_advantages(
    outcome: float,
    v0: float,
    continuations: dict[int, list[float | None]],
    turns: int,
    potentials: list[float] | None = None,
    *,
    gamma: float = 1.0,
    lam: float = 0.0,
    shaping: float = 0.0,
) -> tuple[list[float], int]:
    """One episode's ``[turns]`` advantages and how many of its boundaries had a value.

    Args:
        outcome: the episode's reward (on its last turn); v0: ``V(s_0)``.
        continuations: boundary ``t`` (1 .. turns - 1) -> the rewards of its continuations
            (None: masked); boundaries elsewhere are ignored.
        potentials: ``Phi(s_0) .. Phi(s_turns)`` for shaping (None: no shaping).
    """
    S, K = turns + 1, max([len(v) for v in continuations.values()] + [1])
    rets = torch.zeros(1, S, K, dtype=torch.float64)
    ok = torch.zeros(1, S, K, dtype=torch.bool)
    for t, rs in continuations.items():
        if 1 <= t < turns:
            for k, r in enumerate(rs):
                if r is not None:
                    rets[0, t, k], ok[0, t, k] = r, True
    values, known = A.mc_turn_values(rets, ok)  # (1, S)
    values[0, 0], known[0, 0] = v0, True
    mask = torch.ones(1, turns, dtype=torch.bool)
    rewards = torch.tensor([turn_rewards(outcome, turns, potentials, gamma, shaping)])
    adv, _ = A.turn_advantages(values, known, rewards, mask, gamma=gamma, lam=lam)
    return adv[0].tolist(), int(known[0, :turns].sum())


def turn_rewards(
    outcome: float, turns: int, potentials: list[float] | None, gamma: float, shaping: float
) -> list[float]:
    """``[turns]`` float rewards: the outcome on the last turn, plus ``shaping * F_t`` with
    ``F_t = gamma Phi(s_{t+1}) - Phi(s_t)`` and ``Phi`` of the terminal pinned to 0
    (:func:`coderl.algorithms.potential_shaping`, Ng et al. 1999, Theorem 1) when
    ``potentials`` (``turns + 1`` values) are given and ``shaping > 0``."""
    mask = torch.ones(1, turns, dtype=torch.bool)
    rewards = torch.zeros(1, turns, dtype=torch.float64)
    rewards[0, -1] = outcome
    if potentials is not None and shaping > 0:
        phi = torch.tensor([potentials], dtype=torch.float64)  # (1, turns + 1)
        rewards = rewards + shaping * A.potential_shaping(phi, mask, gamma=gamma)
    return rewards[0].tolist()


def potentials_of(cfg: Config, ep: EpisodeRecord, task: Any) -> list[float] | None:
    """``Phi(s_0) .. Phi(s_n)`` of an episode from its harness tool log (the potentials the
    harness measured after its ``run`` calls, else its task's visible FAIL_TO_PASS tests in their
    output; None without shaping or a tool log)."""
    if cfg.reward.shaping <= 0 or ep.episode is None or task is None:
        return None
    return visible_potentials(ep.episode.tool_calls, visible_fail_to_pass(task), ep.turns)
