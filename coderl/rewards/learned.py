"""The learned reward terms ``judge`` and ``rm`` and the tests-gate that composes them with the
verifiable reward.

Both terms have the signature of every reward term, ``term(samples, cfg) -> list[float]``, and
are registered in :data:`coderl.rewards.terms.REWARD_TERMS`. Each builds its grader once per
process from its config section (``reward.judge``, ``reward.rm``) and keeps it; a driver that
already holds a grader passes ``terms={"judge": grader_term(judge)}`` to ``compute_rewards``.
A masked judgement is NaN, which the composer masks and counts (``term_errors``).

Per-criterion judge scores (rescaled to [0, 1], unweighted) go into ``sample.details`` as
``judge/<criterion>``; the composer copies them into the reward breakdown, outside the total.

The tests-gate (``reward.learned_requires_tests``): a learned term is computed only on samples
whose tests pass (``resolved``); every other sample gets 0 from it whatever the grader would say,
and the grader is not even called on them. A learned grader then ranks correct solutions; it
cannot turn a failing patch into reward.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from coderl.config import RewardConfig
from coderl.config.reward_order import LEARNED
from coderl.graders.judge import EpisodeView, Judge, tests_report, tool_log_summary
from coderl.rewards.sample import RewardSample, Term

LEARNED_TERMS = LEARNED
"""Reward terms from learned graders: the ones the tests-gate applies to (named once, in
:data:`coderl.config.reward_order.LEARNED`)."""

_GRADERS: dict[tuple[str, str], Any] = {}


def view_of(s: RewardSample) -> EpisodeView:
    """The :class:`EpisodeView` of a reward sample."""
    return EpisodeView(s.task_id, s.statement, s.diff, s.tool_log, s.tests_report)


def learned_fields(task: Any, episode: Any, grade: Any) -> dict[str, str]:
    """The :class:`~coderl.rewards.terms.RewardSample` fields learned graders read, from a task
    (its ``problem_statement``), an ``EpisodeRecord`` (``answer`` when it is a diff string, the
    harness episode's ``diff`` and ``tool_calls``) and a ``GradeRecord`` (its ``result.tests``).
    Missing parts give empty strings; a driver without them still gets a valid sample."""
    harness = getattr(episode, "episode", None)
    diff = getattr(harness, "diff", None)
    if diff is None:
        diff = episode.answer if isinstance(episode.answer, str) else ""
    result = getattr(grade, "result", None)
    outcomes = getattr(result, "tests", None)
    return {
        "statement": str(getattr(task, "problem_statement", "") or ""),
        "diff": diff,
        "tool_log": tool_log_summary(harness.tool_calls) if harness is not None else "",
        "tests_report": tests_report(outcomes, grade.resolved) if outcomes else "",
    }


def grader_term(grader: Any, prefix: str = "judge") -> Term:
    """A reward term from a grader object (a :class:`~coderl.graders.judge.Judge` or a
    :class:`~coderl.graders.rm.RewardModelGrader`). A judge's per-criterion scores go into
    ``sample.details`` under ``prefix/``."""

    def term(samples: list[RewardSample], cfg: RewardConfig) -> list[float]:
        views = [view_of(s) for s in samples]
        if hasattr(grader, "judge_all"):
            out = []
            for s, j in zip(samples, grader.judge_all(views), strict=True):
                if j is not None:
                    s.details.update({f"{prefix}/{k}": v for k, v in j.normalised.items()})
                out.append(math.nan if j is None else j.score)
            return out
        return list(grader.score(views))

    return term


def tests_gated(term: Term) -> Term:
    """``term`` computed on the resolved samples only; 0.0 for the others (see the module
    docstring)."""

    def gated(samples: list[RewardSample], cfg: RewardConfig) -> list[float]:
        idx = [i for i, s in enumerate(samples) if s.resolved]
        out = [0.0] * len(samples)
        if idx:
            values = term([samples[i] for i in idx], cfg)
            if len(values) != len(idx):  # the composer's arity check must still see a bad term
                return list(values)
            for i, v in zip(idx, values, strict=True):
                out[i] = v
        return out

    return gated


def _cached(kind: str, section: Any, build: Callable[[], Any]) -> Any:
    key = (kind, section.model_dump_json())
    if key not in _GRADERS:
        _GRADERS[key] = build()
    return _GRADERS[key]


def _generating_judge(cfg: Any, policy: Any, cache: Any) -> Any:
    from coderl.graders.rubric import load_rubric

    return Judge(policy, policy.tokenizer, load_rubric(cfg.rubric), model_id=cfg.model,
                 cache=cache, mode=cfg.mode, max_new_tokens=cfg.max_new_tokens,
                 temperature=cfg.temperature, max_chars=cfg.max_chars, seed=cfg.seed)  # fmt: skip


def _probability_judge(cfg: Any, policy: Any, cache: Any) -> Any:
    from coderl.graders.probjudge import LocalScorer, ProbJudge
    from coderl.graders.rubric import load_rubric

    scorer = LocalScorer(policy.model, int(policy.pad_token_id))
    return ProbJudge(scorer, policy.tokenizer, load_rubric(cfg.rubric), model_id=cfg.model,
                     cache=cache, mode=cfg.mode, max_chars=cfg.max_chars)  # fmt: skip


JUDGES: dict[str, Callable[[Any, Any, Any], Any]] = {
    "probability": _probability_judge,
    "generate": _generating_judge,
}
"""``reward.judge.scoring`` -> builder(section, policy, cache); the only dispatch point."""


def build_judge(cfg: Any) -> Any:
    """The judge of a ``reward.judge`` section (loads the model): a
    :class:`~coderl.graders.probjudge.ProbJudge` or a :class:`~coderl.graders.judge.Judge`.

    Raises:
        ValueError: an unknown ``scoring`` (lists the valid ones).
    """
    from coderl.graders.cache import JudgementCache
    from coderl.policy.loading import load_policy

    if cfg.scoring not in JUDGES:
        raise ValueError(f"unknown judge scoring {cfg.scoring!r}; valid: {sorted(JUDGES)}")
    policy = load_policy(cfg.model, reference=False, seed=cfg.seed)
    cache = JudgementCache(cfg.cache) if cfg.cache else None
    return JUDGES[cfg.scoring](cfg, policy, cache)


def learned_grader(name: str, cfg: RewardConfig) -> Any:
    """The process's grader of learned term ``name`` (``judge`` or ``rm``) built from its
    ``reward`` section, once: the reward term and the probes (:class:`coderl.eval.observers.
    Probes`, the online gate) score with the same object.

    Raises:
        ValueError: ``name`` is not a learned term; ``rm`` without ``reward.rm.checkpoint``.
    """
    if name == "judge":
        return _cached("judge", cfg.judge, lambda: build_judge(cfg.judge))
    if name != "rm":
        raise ValueError(f"unknown learned term {name!r}; valid: {list(LEARNED_TERMS)}")
    if not cfg.rm.checkpoint:
        raise ValueError("reward.terms.rm needs reward.rm.checkpoint (a `coderl rm train` output)")
    from coderl.graders.rm import RewardModelGrader

    ckpt, squash = cfg.rm.checkpoint, cfg.rm.squash
    return _cached("rm", cfg.rm, lambda: RewardModelGrader.load(ckpt, squash=squash))


def configured_learned(cfg: RewardConfig) -> list[str]:
    """The learned terms among ``cfg.terms``, in config order."""
    return [t for t in cfg.terms if t in LEARNED_TERMS]


def judge_term(samples: list[RewardSample], cfg: RewardConfig) -> list[float]:
    """``reward.terms.judge``: the rubric score in [0, 1] of each sample (NaN: masked)."""
    return grader_term(learned_grader("judge", cfg))(samples, cfg)


def rm_term(samples: list[RewardSample], cfg: RewardConfig) -> list[float]:
    """``reward.terms.rm``: the reward model's score (``sigmoid(r)`` with ``reward.rm.squash``).

    Raises:
        ValueError: ``reward.rm.checkpoint`` is not set.
    """
    return grader_term(learned_grader("rm", cfg))(samples, cfg)
