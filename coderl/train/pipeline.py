"""The one rollout-to-batch pipeline that every driver calls (``coderl train``, the async rollout
workers and learner of ``coderl train-async``, the online update)::

    tasks   = sampler.take(n)                                # coderl.train.sampling
    records = env.rollout(policy, tasks, params(seed), G)    # rollout_seed(run seed, unit, attempt)
    scored  = score(env, policy, cfg, tasks, keys, records)  # grade -> attribute -> reward samples
    batch   = make_batch(cfg, policy, value_head, ...)       # advantages over valid samples
    metrics = step_metrics(infos, cfg)                       # same names in every driver
    metrics |= observe_step(observers, cfg, step, infos)     # what the driver registered

Masks, all of them here: a sample is left out of the loss when its episode or its grade failed for
an ``infra`` reason (harness exception, grader bug, missing environment; see
:mod:`coderl.envs.base`), or when a reward term crashed or timed out on it
(:func:`coderl.rewards.compute_rewards`). An ``agent`` failure (broken calls that end the episode,
a self-summary that leaves no room, a grade the agent's own code broke) is **not** masked: it is
scored like a wrong answer, so no action of the policy can turn its sample into "no number".

Groups that lose members are **renormalised, not refilled**: advantages are computed over the
remaining valid members of each group (their mean, and std for GRPO); a group left with one member
gets advantage 0 (:func:`coderl.algorithms.group_advantages`). A group is keyed by task and its
position in the task stream (``group_key``), so the same task drawn twice keeps two baselines.

Every step logs ``infra_failed_rate`` and ``agent_failed_rate`` (shares of the step's episodes)
and ``masked_rate`` (infra and reward-term masks together); above ``reward.mask_alarm_rate`` the
step logs a warning and ``alarm/masked=1``.

Hack detectors (:mod:`coderl.rewards.hacks`) read every graded episode's tool log and diff. They
only observe: no reward, mask, sample or random draw depends on them. Every step logs
``hacks/suspected_rate`` (share of episodes with a flag) and ``hacks/<detector>`` (share each
detector flagged), with ``alarm/hacks=1`` and a warning above ``reward.hack_alarm_rate``.

Step observers (:class:`StepObserver`): what a driver registers to watch its steps without
touching them, the audit log, the learned graders' gameability probes and the judge's criteria
metrics (:mod:`coderl.eval.observers`, above this module: the pipeline imports nothing of
``eval`` nor of the graders' probes). :func:`score` hands each scored set to them and
:func:`observe_step` collects their step metrics.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from coderl.config import Config
from coderl.envs.base import Environment, EpisodeRecord, FailureKind, GradeRecord
from coderl.metrics import reward_metrics, step_alarm
from coderl.policy.base import SamplingParams
from coderl.rewards import RewardResult, RewardSample, compute_rewards
from coderl.rewards.hacks import HackFlag, detect_hacks, flag_counts, suspected_hack_rate
from coderl.rewards.learned import learned_fields
from coderl.train.advantages import episode_advantages, gae_advantages, turn_token_advantages
from coderl.train.batch import StepBatch, build_batch
from coderl.train.step import forward
from coderl.trajectory import Segment, Trajectory, kv_metrics, prefill_accounting

log = logging.getLogger("coderl.train")

AGENT_ENDINGS = {
    "broken_calls": "the episode ended on repeated broken tool calls",
    "context": "the policy's self-summary or observations left the context no room for a turn",
}
"""Finish reasons that the policy caused and that end an episode early: scored, never masked."""


def rollout_seed(run_seed: int, unit: int, attempt: int = 0) -> int:
    """Sampling seed of one rollout (one ``env.rollout`` call): ``coderl train`` uses
    (step, dynamic-sampling round), the async ledger (rollout block, re-sample attempt). A pure
    function, so a resumed run samples what the uninterrupted one would have."""
    return run_seed * 7919 + unit * 101 + attempt


def group_key(task_id: str, position: int) -> str:
    """The advantage group of the episodes of the task at ``position`` in the task stream."""
    return f"{task_id}#{position}"


def sampling_params(cfg: Config, seed: int, temperature: float | None = None) -> SamplingParams:
    """Rollout sampling parameters of ``cfg.rollout`` (``temperature`` overrides, for eval)."""
    r = cfg.rollout
    t = r.temperature if temperature is None else temperature
    return SamplingParams(temperature=t, top_p=r.top_p, max_new_tokens=r.max_new_tokens, seed=seed)


def attribute(ep: EpisodeRecord, grade: GradeRecord) -> tuple[FailureKind | None, str]:
    """Who made this episode yield no reward: ``("infra", reason)``, ``("agent", reason)`` or
    ``(None, "")``. Infra wins over agent (a sample the infrastructure broke is never scored).

    Rules: the episode's own ``failure`` if set; else ``finish_reason="error"`` is infra (an
    unexpected harness exception) and the endings in ``AGENT_ENDINGS`` are agent. A
    ``grading_error`` takes the grade's ``failure_kind``, ``infra`` when it names none.
    """
    kinds: list[tuple[FailureKind, str]] = []
    if ep.failure is not None:
        kinds.append((ep.failure, ep.failure_reason or f"episode: {ep.finish_reason}"))
    elif ep.finish_reason == "error":
        kinds.append(("infra", f"episode error: {ep.failure_reason or 'harness error'}"))
    elif ep.finish_reason in AGENT_ENDINGS:
        kinds.append(("agent", f"episode {ep.finish_reason}: {AGENT_ENDINGS[ep.finish_reason]}"))
    if grade.grading_error is not None or grade.failure_kind is not None:
        kind: FailureKind = grade.failure_kind or "infra"
        kinds.append((kind, f"grading: {grade.grading_error or 'no verdict'}"))
    for wanted in ("infra", "agent"):
        for kind, reason in kinds:
            if kind == wanted:
                return kind, reason
    return None, ""


def reward_samples(
    env: Environment,
    tasks: list[Any],
    keys: list[str],
    episodes: list[EpisodeRecord],
    grades: list[GradeRecord],
    failures: list[tuple[FailureKind | None, str]],
) -> list[RewardSample]:
    """What the reward terms see of each graded episode. An infra failure becomes the sample's
    ``grading_error`` (masked by :func:`coderl.rewards.compute_rewards`); an agent failure of the
    grade is a failed grade (not resolved, nothing passed) and is scored.

    Args:
        tasks: each episode's task; keys: each episode's advantage group (:func:`group_key`).
    """
    budget = env.token_budget()
    out = []
    for task, key, ep, g, (kind, reason) in zip(
        tasks, keys, episodes, grades, failures, strict=True
    ):
        graded = g.grading_error is None and g.failure_kind is None
        out.append(
            RewardSample(
                task_id=key,
                resolved=g.resolved if graded else False,
                fraction_passed=g.fraction_passed if graded else 0.0,
                grading_error=reason if kind == "infra" else None,
                sampled_tokens=sum(s.num_sampled for s in ep.trajectory.segments),
                token_budget=budget,
                broken_tool_calls=ep.broken_tool_calls,
                ease=env.ease(task),
                **learned_fields(task, ep, g),  # what a judge or reward model reads
            )
        )
    return out


Reference = Callable[[Any, float], torch.Tensor]
"""``(tokens, temperature) -> [b, T]`` logprobs of a reference policy (no grad), e.g.
``policy.reference_logprobs`` or the online update's frozen champion."""


@torch.no_grad()
def reference_logprobs(
    reference: Reference, batch: StepBatch, *, micro_batch_size: int, temperature: float
) -> torch.Tensor:
    """``[B, T]`` reference-policy logprobs of the batch's tokens, micro-batched."""
    mbs = micro_batch_size
    parts = [
        reference(batch.rows(i, i + mbs).tokens, temperature) for i in range(0, batch.size, mbs)
    ]
    return torch.cat(parts)


def token_batch(
    policy: Any,
    segments: list[Segment],
    advantages: list[float],
    *,
    micro_batch_size: int,
    temperature: float,
    reference: Reference | None = None,
) -> StepBatch:
    """The trainer's batch of ``segments`` (one row each, ``advantages`` per row) on the
    policy's device, with the ``reference`` logprobs (micro-batched) when one is given: the one
    batch builder of every driver (:func:`make_batch` of ``coderl train`` and the async
    learner, :func:`coderl.online.update.update` of the online wing)."""
    batch = build_batch(segments, advantages, policy.pad_token_id).to(policy.device)
    if reference is not None:
        batch.ref_logp = reference_logprobs(
            reference, batch, micro_batch_size=micro_batch_size, temperature=temperature
        )
    return batch


def fill_kl_k1(
    policy: Any, cfg: Config, episodes: list[EpisodeRecord], samples: list[RewardSample]
) -> None:
    """k1 = sum over sampled tokens of (behaviour logp - reference logp), per episode, for the
    KL reward term (episodes without sampled tokens keep 0), untrained ones included."""
    segs = [
        (i, replace(s, loss_mask=s.sampled_mask()))
        for i, ep in enumerate(episodes)
        for s in ep.trajectory.segments
        if s.num_sampled > 0
    ]
    if not segs:
        return
    batch = token_batch(
        policy,
        [s for _, s in segs],
        [0.0] * len(segs),
        micro_batch_size=cfg.trainer.micro_batch_size,
        temperature=cfg.rollout.temperature,
        reference=policy.reference_logprobs,
    )
    assert batch.ref_logp is not None
    k1 = ((batch.tokens.behavior_logprobs - batch.ref_logp) * batch.tokens.loss_mask).sum(
        -1
    )  # (B,)
    for (i, _), v in zip(segs, k1.tolist(), strict=True):
        samples[i].kl_k1 += v


class StepObserver(Protocol):
    """Watches the pipeline's steps; never changes a reward, mask, sample or random draw."""

    def scored(self, cfg: Config, scored: Scored) -> None:
        """Annotate ``scored.infos`` (plain data: an async worker's infos cross processes)."""

    def step(self, cfg: Config, step: int, infos: list[dict[str, Any]]) -> dict[str, float]:
        """Metrics (and side effects, e.g. ``audit.jsonl``) of step ``step`` (1 first)."""
        ...


def observe_step(
    observers: Sequence[StepObserver], cfg: Config, step: int, infos: list[dict[str, Any]]
) -> dict[str, float]:
    """Every observer's metrics of one step, merged (later observers win on a shared name)."""
    m: dict[str, float] = {}
    for o in observers:
        m.update(o.step(cfg, step, infos))
    return m


@dataclass
class Scored:
    """A graded, rewarded rollout: one entry per episode in every list."""

    episodes: list[EpisodeRecord]
    keys: list[str]
    """Advantage group of each episode (:func:`group_key`)."""
    samples: list[RewardSample]
    rewards: RewardResult
    failures: list[tuple[FailureKind | None, str]]
    """(kind, reason) per episode, see :func:`attribute`."""
    grading_s: float = 0.0
    infos: list[dict[str, Any]] = field(default_factory=list)
    """Per episode: what :func:`step_metrics` reads (plain values: it crosses processes)."""
    grades: list[GradeRecord] = field(default_factory=list)
    flags: list[list[HackFlag]] = field(default_factory=list)
    """Hack flags per episode (:func:`coderl.rewards.hacks.detect_hacks`)."""
    observers: Sequence[StepObserver] = ()
    """Who sees this set each time it is (re)scored (:func:`rescore`)."""
    tasks: list[Any] = field(default_factory=list)
    """Each episode's task (what its continuations are graded against)."""


def episode_info(
    ep: EpisodeRecord,
    sample: RewardSample,
    total: float,
    valid: bool,
    breakdown: dict[str, float],
    failure: tuple[FailureKind | None, str],
    flags: Sequence[HackFlag] = (),
) -> dict[str, Any]:
    """The plain-data summary of one scored episode (see :func:`step_metrics`); observers may
    add entries (:class:`StepObserver`)."""
    return {
        "valid": bool(valid),
        "total": float(total),
        "resolved": bool(sample.resolved),
        "failure": failure[0],
        "failure_reason": failure[1],
        "sampled_tokens": sample.sampled_tokens,
        "untrained_tokens": sum(s.num_sampled - s.num_trainable for s in ep.trajectory.segments),
        "truncated": bool(ep.truncated),
        "turns": ep.turns,
        "segments": len(ep.trajectory.segments),
        "broken_tool_calls": ep.broken_tool_calls,
        "no_action_turns": ep.no_action_turns,
        "summaries": ep.summaries,
        "continued_after_summary": ep.turns_after_summary > 0,
        **prefill_accounting(ep.trajectory),
        "breakdown": dict(breakdown),
        "hack_flags": [asdict(f) for f in flags],
    }


def score(
    env: Environment,
    policy: Any,
    cfg: Config,
    tasks: list[Any],
    keys: list[str],
    episodes: list[EpisodeRecord],
    observers: Sequence[StepObserver] = (),
) -> Scored:
    """:func:`grade`, then :func:`rescore`: the rewards; ``observers`` see the scored set."""
    return rescore(grade(env, policy, cfg, tasks, keys, episodes, observers), cfg)


def grade(
    env: Environment,
    policy: Any,
    cfg: Config,
    tasks: list[Any],
    keys: list[str],
    episodes: list[EpisodeRecord],
    observers: Sequence[StepObserver] = (),
) -> Scored:
    """Grade ``episodes`` (``tasks`` and ``keys``: per episode), attribute failures, run the
    hack detectors (they only observe) and build the reward samples with every mask; the
    rewards are :func:`rescore`'s (a sharded run grades its share, rescores the whole).

    Raises:
        ValueError: list lengths differ (from the strict zips).
    """
    t0 = time.perf_counter()
    grades = env.grade(tasks, episodes)
    failures = [attribute(ep, g) for ep, g in zip(episodes, grades, strict=True)]
    samples = reward_samples(env, tasks, keys, episodes, grades, failures)
    if "kl" in cfg.reward.terms and cfg.reward.kl_coef > 0:
        fill_kl_k1(policy, cfg, episodes, samples)
    grading_s = time.perf_counter() - t0
    flags = [detect_hacks(ep, g, t) for ep, g, t in zip(episodes, grades, tasks, strict=True)]
    empty = RewardResult([], [], [])
    return Scored(
        episodes, keys, samples, empty, failures, grading_s, [], grades, flags, observers,
        list(tasks),
    )  # fmt: skip


def rescore(scored: Scored, cfg: Config) -> Scored:
    """Rewards (and per-episode infos) of ``scored``'s samples computed together: group pass
    rates are per group, so a subset's rewards are recomputed over that subset; then its
    observers see the set (:class:`StepObserver`)."""
    rewards = compute_rewards(scored.samples, cfg.reward)
    scored.rewards = rewards
    rows = zip(
        scored.episodes,
        scored.samples,
        rewards.totals,
        rewards.valid,
        rewards.breakdown,
        scored.failures,
        scored.flags,
        strict=True,
    )
    scored.infos = [episode_info(*row) for row in rows]
    for o in scored.observers:
        o.scored(cfg, scored)
    return scored


def select(scored: Scored, keep: list[int]) -> Scored:
    """The episodes at indices ``keep`` (rewards not recomputed: call :func:`rescore`)."""
    return Scored(
        [scored.episodes[i] for i in keep],
        [scored.keys[i] for i in keep],
        [scored.samples[i] for i in keep],
        RewardResult([], [], []),
        [scored.failures[i] for i in keep],
        scored.grading_s,
        [],
        [scored.grades[i] for i in keep],
        [scored.flags[i] for i in keep],
        scored.observers,
        [scored.tasks[i] for i in keep] if scored.tasks else [],
    )


def zero_variance_groups(keys: list[str], rewards: RewardResult) -> set[str]:
    """Groups whose valid rewards are all equal (or that have fewer than 2 valid members)."""
    by_group: dict[str, list[float]] = {}
    for k, r, ok in zip(keys, rewards.totals, rewards.valid, strict=True):
        if ok:
            by_group.setdefault(k, []).append(r)
    return {k for k, rs in by_group.items() if len(rs) < 2 or max(rs) - min(rs) < 1e-12}


def make_batch(
    cfg: Config,
    policy: Any,
    value_head: nn.Module | None,
    trajectories: list[Trajectory],
    totals: list[float],
    valid: list[bool],
    keys: list[str],
    turn_adv: list[list[float]] | None = None,
) -> StepBatch | None:
    """Advantages and the token batch of every valid episode's segments (None: no valid one,
    or no sampled token in any).

    One row per segment (context window; a summary is the last action of its window). Group
    estimators (:func:`coderl.train.advantages.episode_advantages`) count each valid *episode*
    once in its group (renormalised, see the module docstring); every segment of it, summary
    included, carries its advantage. GAE (PPO, needs ``value_head``) runs over an episode's
    segments as one sequence (:func:`coderl.train.advantages.gae_advantages`). Segments without
    a sampled token are left out. With ``algorithm.kl.coef > 0`` the batch carries reference
    logprobs. ``vineppo`` gives each turn's tokens its advantage from ``turn_adv``
    (:func:`coderl.train.advantages.turn_token_advantages`; computed from the continuations by
    :func:`coderl.train.branching.turn_credit`).

    Args:
        trajectories, totals, valid, keys: per episode (reward totals are NaN where invalid).
        turn_adv: ``vineppo`` only: per episode, its per-turn advantages.

    Raises:
        ValueError: ``gae`` without a value head; ``vineppo`` without ``turn_adv``.
    """
    keep = [i for i, ok in enumerate(valid) if ok]
    if not keep:
        return None
    gae = cfg.algorithm.advantage == "gae"
    vine = cfg.algorithm.advantage == "vineppo"
    if vine and turn_adv is None:
        raise ValueError(
            "algorithm.advantage=vineppo needs per-turn advantages from continuations "
            "(coderl train; train-async and online do not branch)"
        )
    if not gae and not vine:
        ids = {k: j for j, k in enumerate(sorted({keys[i] for i in keep}))}
        a = episode_advantages(
            cfg.algorithm.advantage,
            [totals[i] for i in keep],
            [ids[keys[i]] for i in keep],
            [True] * len(keep),
        )
    segs, adv, seg_reward, seg_episode = [], [], [], []
    tok_adv: list[list[float]] = []
    for j, i in enumerate(keep):
        for s in trajectories[i].segments:
            if s.num_trainable == 0:  # e.g. the window a too-long summary opened: nothing to train
                continue
            segs.append(s)
            adv.append(0.0 if gae or vine else float(a[j]))
            if vine:
                assert turn_adv is not None
                tok_adv.append(turn_token_advantages(s, turn_adv[i]))
            seg_reward.append(totals[i])
            seg_episode.append(j)
    if not segs:
        return None
    batch = token_batch(  # on trainer.device
        policy,
        segs,
        adv,
        micro_batch_size=cfg.trainer.micro_batch_size,
        temperature=cfg.rollout.temperature,
        reference=policy.reference_logprobs if cfg.algorithm.kl.coef > 0 else None,
    )
    if vine:
        per_token = torch.zeros(batch.loss_mask.shape, dtype=torch.float32)  # (B, T)
        for r, row in enumerate(tok_adv):
            per_token[r, : len(row)] = torch.tensor(row)
        batch.advantages = per_token.to(batch.loss_mask.device)
    if gae:
        if value_head is None:
            raise ValueError("algorithm.advantage=gae needs a value head")
        mbs = cfg.trainer.micro_batch_size
        parts = []
        with torch.no_grad():
            for i in range(0, batch.size, mbs):
                out = forward(
                    policy.model,
                    batch.rows(i, i + mbs).tokens,
                    temperature=cfg.rollout.temperature,
                    value_head=value_head,
                )
                assert out.values is not None  # a value head was given
                parts.append(out.values)
        values = torch.cat(parts)  # (B, T)
        values = values * batch.loss_mask
        batch.advantages, batch.returns = gae_advantages(
            torch.tensor(seg_reward, device=values.device),
            values,
            batch.loss_mask,
            torch.tensor(seg_episode, device=values.device),
            gamma=cfg.algorithm.gamma,
            lam=cfg.algorithm.lam,
        )
        batch.old_values = values
    return batch


def advantage_metrics(batch: StepBatch) -> dict[str, float]:
    adv = batch.advantages if batch.advantages.dim() == 1 else batch.advantages[batch.loss_mask]
    return {
        "advantage/mean": float(adv.mean()),
        "advantage/std": float(adv.std()) if adv.numel() > 1 else 0.0,
        "advantage/abs_max": float(adv.abs().max()),
        "advantage/zero_frac": float((adv == 0).float().mean()),
    }


def _mean(xs: list[float]) -> float:
    return float(np.mean(xs)) if xs else math.nan


def step_metrics(
    infos: list[dict[str, Any]], cfg: Config, measured: list[dict[str, Any]] | None = None
) -> dict[str, float]:
    """Per-step episode, reward and failure metrics of a step's episodes (any driver).

    ``reward/*``, ``resolved_rate``, ``measured_episodes``: :func:`coderl.metrics.reward_metrics`
    of ``measured``, every episode the step graded (default ``infos``; ``coderl train`` passes
    every round's, dropped groups included); ``episodes``: those trained on. ``episode/*`` are per
    episode; ``infra_failed_rate``, ``agent_failed_rate`` and ``masked_rate`` are shares of all
    the step's episodes (``reward/masked`` and ``reward/grading_errors``: counts). When ``masked_rate > reward.mask_alarm_rate`` a warning is logged
    (logger ``coderl.train``) and ``alarm/masked`` is 1. ``hacks/suspected_rate`` and
    ``hacks/<detector>`` are shares of all the step's episodes (from each info's ``hack_flags``);
    above ``reward.hack_alarm_rate``, ``alarm/hacks`` is 1 with a warning. ``summary/*``: see
    :func:`summary_metrics`; ``kv/*``: :func:`coderl.trajectory.kv_metrics`.
    """
    n = len(infos)
    d = max(n, 1)
    valid = [x for x in infos if x["valid"]]
    m: dict[str, float] = {"episodes": float(n)}
    m.update(reward_metrics(infos if measured is None else measured, cfg.reward.terms))
    counts = ("sampled_tokens", "untrained_tokens", "turns", "segments", "broken_tool_calls")
    for key in (*counts, "no_action_turns"):
        m[f"episode/{key}"] = sum(x[key] for x in infos) / d
    m["episode/truncated_rate"] = sum(x["truncated"] for x in infos) / d
    m.update(summary_metrics(infos))
    m.update(kv_metrics(infos))
    infra = sum(x["failure"] == "infra" for x in infos)
    m["infra_failed_rate"] = infra / d
    m["agent_failed_rate"] = sum(x["failure"] == "agent" for x in infos) / d
    m["masked_rate"] = (n - len(valid)) / d
    m["reward/masked"] = float(n - len(valid))
    m["reward/grading_errors"] = float(infra)  # infra failures reach the rewards as these
    masked_reasons = sorted({x["failure_reason"] for x in infos if x["failure"] == "infra"})
    step_alarm(
        m,
        "masked",
        m["masked_rate"],
        "reward.mask_alarm_rate",
        cfg.reward.mask_alarm_rate,
        lambda: (
            f"{n - len(valid)} of {n} episodes: {infra} infra failures, the rest "
            f"reward-term failures; infra reasons: {'; '.join(masked_reasons[:5]) or '-'}"
        ),
    )
    flags = [[HackFlag(**f) for f in x["hack_flags"]] for x in infos]
    m["hacks/suspected_rate"] = suspected_hack_rate(flags)
    counts = flag_counts(flags)
    for name, count in counts.items():
        m[f"hacks/{name}"] = count / d
    evidence = [f"{f.name}: {f.evidence}" for fl in flags for f in fl]
    step_alarm(
        m,
        "hacks",
        m["hacks/suspected_rate"],
        "reward.hack_alarm_rate",
        cfg.reward.hack_alarm_rate,
        lambda: (
            f"{sum(bool(f) for f in flags)} of {n} episodes flagged: "
            + ", ".join(f"{k} {v}" for k, v in counts.items() if v)
            + f"; first evidence: {'; '.join(evidence[:3])}"
        ),
    )
    return m


def summary_metrics(infos: list[dict[str, Any]]) -> dict[str, float]:
    """Self-summarization of a step's episodes: ``summary/per_episode`` (summaries per
    episode), ``summary/episodes_with`` (share of episodes with at least one) and
    ``summary/episodes_continued`` (share that took a turn in a window a summary opened), over
    all the step's episodes; ``summary/resolved_continued`` the resolved rate of the valid ones
    of those (over ``summary/valid_continued``); ``summary/resolved_with`` and ``summary/resolved_without``, the resolved
    rate of the valid episodes with and without a summary (NaN when there is none), over
    ``summary/valid_with`` and ``summary/valid_without`` episodes (counts, so a run's rate is
    their weighted mean)."""
    d = max(len(infos), 1)
    valid = [x for x in infos if x["valid"]]
    m = {
        "summary/per_episode": sum(x["summaries"] for x in infos) / d,
        "summary/episodes_with": sum(x["summaries"] > 0 for x in infos) / d,
    }
    for name, has in (("with", True), ("without", False)):
        solved = [float(x["resolved"]) for x in valid if bool(x["summaries"]) == has]
        m[f"summary/resolved_{name}"] = _mean(solved)
        m[f"summary/valid_{name}"] = float(len(solved))
    went_on = [x for x in infos if x.get("continued_after_summary")]
    m["summary/episodes_continued"] = len(went_on) / d
    solved = [float(x["resolved"]) for x in went_on if x["valid"]]
    m["summary/resolved_continued"] = _mean(solved)
    m["summary/valid_continued"] = float(len(solved))
    return m
