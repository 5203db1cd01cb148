"""Statistics for evaluation and the eval gate: pure functions on plain lists, each with its
source.

- Confidence intervals by the percentile bootstrap over tasks (:func:`bootstrap_ci`,
  :func:`estimate`, :func:`paired_difference`): Efron & Tibshirani 1993, "An Introduction to the
  Bootstrap", Ch. 13; 2000 resamples, fixed seed. Samples of one task are correlated, so the
  task is the unit.
- Student's t distribution in closed form for integer degrees of freedom
  (:func:`student_t_cdf`, :func:`student_t_quantile`) and the paired t lower bound
  (:func:`paired_t_lower`).
- Score bounds for proportions: Wilson's interval (:func:`wilson_interval`), Newcombe's method 10
  and Tango's score bound for paired proportions (:func:`newcombe_paired_lower`,
  :func:`tango_paired_lower`, :func:`paired_binary_lower`).

Used by :mod:`coderl.eval.passk` (pass@k with CIs, before/after comparisons) and
:mod:`coderl.online.gate` (paired non-inferiority). No I/O, no configuration objects.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

BOOTSTRAP_RESAMPLES = 2000


class NothingMeasured(ValueError):
    """Every episode of an evaluation or a training step was masked (grading errors, infra
    failures, dropped episodes): there is no number to report or to train on. A
    ``ValueError``, so the command line prints it as one line and exits non-zero."""


def bootstrap_ci(values: list[float], *, level: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Percentile-bootstrap CI of the mean of ``values`` (one value per task).

    Raises:
        ValueError: no values, or ``level`` outside (0, 1).
    """
    if not values:
        raise ValueError("bootstrap_ci needs at least one value")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    x = np.asarray(values, dtype=np.float64)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(x), size=(BOOTSTRAP_RESAMPLES, len(x)))
    means = x[idx].mean(axis=1)
    alpha = (1 - level) / 2
    return float(np.quantile(means, alpha)), float(np.quantile(means, 1 - alpha))


@dataclass
class Estimate:
    """A mean with the ends of its 95% CI."""

    mean: float
    lo: float
    """Lower end of the 95% CI."""
    hi: float
    """Upper end of the 95% CI."""


def estimate(values: list[float], seed: int = 0) -> Estimate:
    """Mean of ``values`` (one per task) with its percentile-bootstrap 95% CI.

    Raises:
        ValueError: no values.
    """
    lo, hi = bootstrap_ci(values, seed=seed)
    return Estimate(float(np.mean(values)), lo, hi)


def paired_difference(before: list[float], after: list[float], seed: int = 0) -> Estimate:
    """Mean of per-task ``after - before`` with its paired-bootstrap 95% CI.

    Raises:
        ValueError: the lists differ in length or are empty.
    """
    if len(before) != len(after) or not before:
        raise ValueError(f"paired lists must be equal and non-empty: {len(before)} vs {len(after)}")
    return estimate([a - b for a, b in zip(after, before, strict=True)], seed)


def student_t_cdf(t: float, df: int) -> float:
    """``P(T <= t)`` for Student's t with integer ``df`` >= 1 degrees of freedom.

    Closed form for integer ``df`` (Abramowitz & Stegun 1964, "Handbook of Mathematical
    Functions", p. 948, eq. 26.7.3 for odd and 26.7.4 for even ``df``): with ``theta = atan(|t| /
    sqrt(df))`` and ``c = cos(theta)``, ``A(t|df) = P(|T| <= |t|)`` is
    ``(2/pi) (theta + sin(theta) (c + 2/3 c^3 + ... + (2.4...(df-3))/(1.3...(df-2)) c^(df-2)))``
    for odd ``df`` (``2 theta / pi`` for ``df = 1``) and
    ``sin(theta) (1 + 1/2 c^2 + 1.3/(2.4) c^4 + ... + (1.3...(df-3))/(2.4...(df-2)) c^(df-2))``
    for even ``df``; then ``P(T <= t) = (1 + sign(t) A) / 2``.

    Raises:
        ValueError: ``df`` < 1.
    """
    if df < 1:
        raise ValueError(f"Student's t needs df >= 1, got {df}")
    theta = math.atan(abs(t) / math.sqrt(df))
    c2 = math.cos(theta) ** 2
    if df % 2 == 1:
        term = total = math.cos(theta) if df > 1 else 0.0
        for k in range(3, df - 1, 2):
            term *= (k - 1) / k * c2
            total += term
        a = 2.0 / math.pi * (theta + math.sin(theta) * total)
    else:
        term = total = 1.0
        for k in range(2, df - 1, 2):
            term *= (k - 1) / k * c2
            total += term
        a = math.sin(theta) * total
    return 0.5 + math.copysign(0.5 * a, t)


def student_t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom, for ``0.5 <= p < 1``,
    by bisection on :func:`student_t_cdf` to a relative precision of 1e-12.

    Raises:
        ValueError: ``p`` outside ``[0.5, 1)`` or ``df`` < 1.
    """
    if not 0.5 <= p < 1.0:
        raise ValueError(f"quantile level must be in [0.5, 1), got {p}")
    lo, hi = 0.0, 1.0
    while student_t_cdf(hi, df) < p:
        lo, hi = hi, 2.0 * hi
    while hi - lo > 1e-12 * hi:
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if student_t_cdf(mid, df) < p else (lo, mid)
    return 0.5 * (lo + hi)


def paired_t_lower(diffs: list[float], quantile: float, sd_floor: float = 0.0) -> float:
    """Student's t lower bound of the mean of paired differences ``d``:
    ``mean(d) - q * max(sd(d), sd_floor) / sqrt(n)`` with ``sd`` using ``n - 1`` (Student 1908,
    "The probable error of a mean", Biometrika 6(1):1-25). ``q = t_{1-alpha, n-1}`` gives a
    one-sided ``1 - alpha`` bound; ``sd_floor`` keeps a fully tied sample from giving a bound of
    exactly the mean (see :func:`coderl.online.gate.paired_noninferiority`).

    Raises:
        ValueError: fewer than 2 differences.
    """
    n = len(diffs)
    if n < 2:
        raise ValueError(f"the t bound needs at least 2 differences, got {n}")
    mean = sum(diffs) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in diffs) / (n - 1))
    return mean - quantile * max(sd, sd_floor) / math.sqrt(n)


def wilson_interval(successes: int, n: int, z: float) -> tuple[float, float]:
    """Wilson's score interval ``(lower, upper)`` for a binomial proportion, ``successes`` of
    ``n`` trials, at normal quantile ``z`` (``z_{1-alpha}`` for one-sided bounds at level
    ``1 - alpha``): ``(2x + z^2 -+ z sqrt(z^2 + 4x(n - x)/n)) / (2(n + z^2))``.

    Source: Wilson (1927), "Probable inference, the law of succession, and statistical
    inference", JASA 22(158):209-212; in this form Newcombe (1998), Statistics in Medicine
    17:857-872, method 3.

    Raises:
        ValueError: ``n`` < 1 or ``successes`` outside ``[0, n]``.
    """
    if n < 1 or not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n and n >= 1; got {successes} of {n}")
    centre = 2 * successes + z * z
    half = z * math.sqrt(z * z + 4 * successes * (n - successes) / n)
    return (centre - half) / (2 * (n + z * z)), (centre + half) / (2 * (n + z * z))


def newcombe_paired_lower(a: int, b: int, c: int, d: int, z: float) -> float:
    """Newcombe's hybrid score lower bound for ``p1 - p2`` from a paired 2x2 table.

    Cells: ``a`` both succeed, ``b`` only the first (candidate), ``c`` only the second
    (champion), ``d`` neither; ``n = a + b + c + d``, ``p1 = (a + b) / n``, ``p2 = (a + c) / n``.
    Source: Newcombe (1998), "Improved confidence intervals for the difference between binomial
    proportions based on paired data", Statistics in Medicine 17:2635-2650, method 10: with
    Wilson score intervals ``(l1, u1)`` for ``p1`` and ``(l2, u2)`` for ``p2`` (see
    :func:`wilson_interval`) and the table's phi correlation
    ``phi = (ad - bc) / sqrt((a + b)(c + d)(a + c)(b + d))`` (0 when the denominator is 0),
    ``L = p1 - p2 - sqrt((p1 - l1)^2 - 2 phi (p1 - l1)(u2 - p2) + (u2 - p2)^2)``. At
    ``z = z_{1-alpha}`` it is a one-sided ``1 - alpha`` lower bound.

    Not valid on its own with concordant tasks of both kinds and few discordant ones: at
    ``b = c = 0`` phi is 1 and the square root is ``|(p1 - l1) - (u2 - p2)|``, 0 when
    ``p1 = 1/2`` (6 tasks, 3 solved by both: a bound of 0); see :func:`paired_binary_lower`.

    Raises:
        ValueError: a negative cell or an empty table.
    """
    if min(a, b, c, d) < 0 or a + b + c + d == 0:
        raise ValueError(f"need a non-empty table of counts >= 0; got {(a, b, c, d)}")
    n = a + b + c + d
    p1, p2 = (a + b) / n, (a + c) / n
    l1, _ = wilson_interval(a + b, n, z)
    _, u2 = wilson_interval(a + c, n, z)
    den = (a + b) * (c + d) * (a + c) * (b + d)
    phi = (a * d - b * c) / math.sqrt(den) if den > 0 else 0.0
    dl, du = p1 - l1, u2 - p2
    return p1 - p2 - math.sqrt(max(dl * dl - 2 * phi * dl * du + du * du, 0.0))


def tango_paired_lower(a: int, b: int, c: int, d: int, z: float) -> float:
    """Tango's score lower bound for ``p1 - p2 = (b - c) / n`` from a paired 2x2 table (cells as
    in :func:`newcombe_paired_lower`).

    Source: Tango (1998), "Equivalence test and confidence interval for the difference in
    proportions for the paired-sample design", Statistics in Medicine 17:891-908 (the score
    test and its restricted MLE; written out as here in Fagerland, Lydersen and Laake 2017,
    "Statistical Analysis of Contingency Tables", Ch. 8): for a hypothesised difference ``D``
    the score statistic is ``Z(D) = (b - c - nD) / sqrt(n (2 q + D (1 - D)))`` with ``q`` the maximum-likelihood
    estimate of the champion-only cell probability under ``p1 - p2 = D``,
    ``q = (sqrt(B^2 - 8 n C) - B) / (4 n)``, ``B = -b - c + (2n - b + c) D``,
    ``C = -c D (1 - D)``. The bound is the smallest ``D`` with ``Z(D) <= z``, found by
    bisection on ``[-1, (b - c) / n]`` (``Z`` falls from +inf to 0 there) to 1e-12. With no
    discordant task it is ``-z^2 / (n + z^2)`` whatever ``a`` and ``d`` are.

    Raises:
        ValueError: a negative cell or an empty table.
    """
    if min(a, b, c, d) < 0 or a + b + c + d == 0:
        raise ValueError(f"need a non-empty table of counts >= 0; got {(a, b, c, d)}")
    n = a + b + c + d

    def score(diff: float) -> float:
        bb = -b - c + (2 * n - b + c) * diff
        cc = -c * diff * (1 - diff)
        q = (math.sqrt(max(bb * bb - 8 * n * cc, 0.0)) - bb) / (4 * n)
        var = n * (2 * q + diff * (1 - diff))
        num = b - c - n * diff
        if var > 0:
            return num / math.sqrt(var)
        return math.inf if num > 0 else 0.0  # var = 0 only at D = -1 and at D = (b - c) / n

    lo, hi = -1.0, (b - c) / n
    while hi - lo > 1e-12:
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if score(mid) > z else (lo, mid)
    return hi


def paired_binary_lower(
    candidate: list[float], champion: list[float], z: float
) -> tuple[float, dict[str, float]]:
    """One-sided lower bound for the difference of paired pass rates of 0/1 scores: the smaller
    of Newcombe's method 10 (:func:`newcombe_paired_lower`) and Tango's score bound
    (:func:`tango_paired_lower`).

    Why both: Newcombe's bound, built from the two marginal Wilson intervals, collapses when the
    tasks are concordant (see its docstring): enumerating every 2x2 table, a candidate worse on
    5 % of tasks and equal elsewhere is promoted at margin 0.05 with probability 0.33 at 12 tasks
    and 0.34 at 20 when about half the tasks are solved by both, where 0.05 was meant. Tango's
    bound works from the discordant cells: 0 there up to 41 tasks (0.037 at 100), at most 0.062
    over a grid of cell probabilities at margin 0.05. The smaller bound passes only if both do,
    so its type I error is at most either's; Newcombe's is the smaller in some tables (by up to
    0.03 at 20 tasks), Tango's in the tied ones.

    Args:
        candidate, champion: per-task scores, each 0 or 1, same tasks in the same order.
        z: normal quantile ``z_{1-alpha}``.

    Returns:
        ``(lower, {"newcombe10": ..., "tango": ...})``.

    Raises:
        ValueError: different lengths, no task, or a score other than 0 and 1.
    """
    pairs = list(zip(candidate, champion, strict=True))
    if not pairs or any(x not in (0, 1) for pair in pairs for x in pair):
        raise ValueError("need paired scores of 0 or 1 on at least one task")
    a = sum(1 for x, y in pairs if x == 1 and y == 1)
    b = sum(1 for x, y in pairs if x == 1 and y == 0)
    c = sum(1 for x, y in pairs if x == 0 and y == 1)
    bounds = {
        "newcombe10": newcombe_paired_lower(a, b, c, len(pairs) - a - b - c, z),
        "tango": tango_paired_lower(a, b, c, len(pairs) - a - b - c, z),
    }
    return min(bounds.values()), bounds


def score_resolution(scores: list[float], max_samples: int = 1000) -> float | None:
    """The grid step of per-task scores: ``1/k`` for the smallest ``k <= max_samples`` such that
    every score is a multiple of ``1/k`` (to 1e-9), else None. Pass rates over ``k`` samples are
    multiples of ``1/k``; the smallest fitting ``k`` is at most the real one, so the step is never
    underestimated (0, 0.5 and 1 from 4 samples give 1/2)."""
    for k in range(1, max_samples + 1):
        if all(abs(s * k - round(s * k)) <= 1e-9 * max(1.0, abs(s * k)) for s in scores):
            return 1.0 / k
    return None
