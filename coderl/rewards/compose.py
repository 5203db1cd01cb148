"""Weight and sum reward terms; mask and count samples whose term crashed or timed out.

A term is called once on the whole batch. If that call raises or exceeds
``reward.term_timeout_s``, the term is called again on each sample alone, and only the samples
that fail alone are masked (``valid=False``) and counted; the run goes on. A term that returns the
wrong number of values is a bug in the term and raises.

Limits: a timed-out term keeps running in its daemon thread (Python cannot stop a thread); a term
that hangs on every sample costs ``term_timeout_s`` per sample.
"""

from __future__ import annotations

import math
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from coderl.config import RewardConfig
from coderl.rewards.learned import LEARNED_TERMS, tests_gated
from coderl.rewards.terms import REWARD_TERMS, RewardSample, Term


@dataclass
class RewardResult:
    """Rewards for a batch of samples."""

    totals: list[float]
    """Weighted sum of the terms per sample (NaN where masked)."""
    valid: list[bool]
    """False where grading failed or a term crashed or timed out for the sample."""
    breakdown: list[dict[str, float]]
    """Per sample: term name -> weighted value (NaN for a term that failed on the sample),
    plus the sample's ``details`` (e.g. ``judge/<criterion>``, not part of the total)."""
    counts: dict[str, int] = field(default_factory=dict)
    """``grading_errors``, ``term_errors``, ``term_timeouts``, ``masked``."""
    errors: list[str] = field(default_factory=list)
    """One line per failure: term, sample index, exception."""


class RewardArityError(ValueError):
    """A reward term returned a different number of values than it was given samples."""


class _TermFailed(Exception):
    """The term raised (whatever it raised, ``BaseException`` included: it is the run's own or
    a plugin's code, run on what the policy wrote), returned a value that is not a number, or
    (per sample) one that is not finite."""


class _TermTimeout(_TermFailed):
    """The term ran past ``reward.term_timeout_s``."""


def _call(name: str, term: Term, samples: list[RewardSample], cfg: RewardConfig) -> list[float]:
    """The term's values on ``samples``, computed in a daemon thread for at most
    ``cfg.term_timeout_s`` seconds.

    Raises:
        RewardArityError: the term returned the wrong number of values (a bug in the term).
        _TermTimeout: it ran past the timeout.
        _TermFailed: it raised (chained) or returned a value ``float`` does not take.
    """
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = _checked(name, term(samples, cfg), len(samples))
        except BaseException as e:  # noqa: BLE001 - a crashing term is part of the domain
            box["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(cfg.term_timeout_s)
    if thread.is_alive():
        raise _TermTimeout(f"timed out after {cfg.term_timeout_s:g} s")
    error = box.get("error")
    if isinstance(error, RewardArityError):
        raise error
    if error is not None:
        raise _TermFailed(f"{type(error).__name__}: {error}") from error
    values: list[float] = box["value"]
    return values


def _checked(name: str, values: Any, n: int) -> list[float]:
    if not isinstance(values, list | tuple) or len(values) != n:
        got = len(values) if isinstance(values, list | tuple) else type(values).__name__
        raise RewardArityError(f"reward term {name!r} returned {got} values for {n} samples")
    return [float(v) for v in values]


def _run_term(
    name: str, term: Term, samples: list[RewardSample], cfg: RewardConfig, result: RewardResult
) -> list[float]:
    """Values of one term; NaN for samples on which it raised, timed out or returned NaN."""
    try:
        values = _call(name, term, samples, cfg)
        if all(math.isfinite(v) for v in values):
            return values
    except _TermFailed:  # isolate the failing samples below
        pass
    out = []
    for i, s in enumerate(samples):
        try:
            [v] = _call(name, term, [s], cfg)
            if not math.isfinite(v):
                raise _TermFailed(f"ArithmeticError: non-finite value {v}")
            out.append(v)
        except _TermFailed as e:  # a crashing or hanging term masks the sample, counted
            timeout = isinstance(e, _TermTimeout)
            result.counts["term_timeouts" if timeout else "term_errors"] += 1
            result.errors.append(f"term {name!r} on sample {i}: {e}")
            out.append(math.nan)
    return out


def _fill_group_pass_rates(samples: list[RewardSample]) -> None:
    solved: dict[str, list[bool]] = defaultdict(list)
    for s in samples:
        if s.grading_error is None:
            solved[s.task_id].append(s.resolved)
    for s in samples:
        group = solved.get(s.task_id, [])
        s.group_pass_rate = sum(group) / len(group) if group else 0.0


def compute_rewards(
    samples: list[RewardSample], cfg: RewardConfig, terms: dict[str, Term] | None = None
) -> RewardResult:
    """Rewards of a batch: ``total_i = sum_name weight_name * term_name(samples)_i``.

    Fills each sample's ``group_pass_rate`` (over samples of the same task without grading
    errors) before calling the terms.

    Args:
        samples: graded episodes, any order, several tasks mixed.
        cfg: the ``reward`` config section (term weights and parameters).
        terms: name -> term registry (default ``REWARD_TERMS``).

    Returns:
        A :class:`RewardResult`; masked samples have ``valid=False`` and a NaN total.

    Raises:
        ValueError: a term name in ``cfg.terms`` is not registered (lists the valid ones).
        RewardArityError: a term returned the wrong number of values.
    """
    registry = REWARD_TERMS if terms is None else terms
    unknown = sorted(set(cfg.terms) - set(registry))
    if unknown:
        raise ValueError(f"reward.terms: unknown terms {unknown}; valid: {sorted(registry)}")
    _fill_group_pass_rates(samples)
    n = len(samples)
    result = RewardResult(
        totals=[0.0] * n,
        valid=[s.grading_error is None for s in samples],
        breakdown=[{} for _ in samples],
        counts={"grading_errors": sum(s.grading_error is not None for s in samples)},
    )
    result.counts.update(term_errors=0, term_timeouts=0)
    for name, weight in cfg.terms.items():
        term = registry[name]
        if cfg.learned_requires_tests and name in LEARNED_TERMS:
            term = tests_gated(term)  # a learned grader cannot reward a failing patch
        values = _run_term(name, term, samples, cfg, result) if n else []
        for i, v in enumerate(values):
            result.breakdown[i][name] = weight * v
            if math.isnan(v):
                result.valid[i] = False
    for i in range(n):
        total = sum(result.breakdown[i].values())
        result.breakdown[i].update(samples[i].details)  # per-criterion scores, not in the total
        result.totals[i] = total if result.valid[i] else math.nan
    result.counts["masked"] = sum(not v for v in result.valid)
    return result
