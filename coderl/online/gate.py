"""The eval gate: a candidate replaces the champion only if it is not worse anywhere that counts.

Checks, all of which must pass:

1. **Held-out suites, paired**: each metric is scored per task for both policies on the same
   tasks, and a one-sided ``1 - alpha`` lower confidence bound of the mean paired difference
   (candidate minus champion) must exceed ``-margin`` for that metric (non-inferiority, H0: the
   candidate is worse by the margin or more; see :func:`paired_noninferiority`). Pass/fail
   scores (every score 0 or 1) get a bound for the difference of paired proportions that stays
   valid with ties (Newcombe's hybrid score interval, guarded by Tango's score interval);
   fractional scores (pass rates over several samples per task) get Student's paired t bound
   with a floor on ``sd(d)``. Training reward plays no part: a candidate that raised it but
   breaches a held-out margin is rejected.
2. **Behaviour checks**: the candidate's behaviour metrics on the held-out episodes compared with
   the champion's under the alarm rules (edit rate, clarifying questions, broken calls...).
3. **Production monitors**: any alarm raised on live traffic blocks promotion.

Limits: both bounds are large-sample approximations. The pass/fail bound's exact type I error
(probability of promoting a candidate exactly ``margin`` worse, alpha = 0.05; every 2x2 table
enumerated for 5, 12, 20 and 40 tasks over a grid of cell probabilities) was at most 0.074 at
margins 0.05 and 0.1 (0.087 at margins up to 0.6, 5 and 12 tasks); Newcombe's method 10 alone
reached 0.37.
The t bound with its floor remains optimistic when fractional scores are heavily tied (most tasks
at 0 or 1 for both policies): simulated type I error up to 0.12 at 12 tasks x 8 samples and
0.081 at 41 x 4 for a candidate 0.05 worse only on the tasks both pass (0.033-0.056 when the
pass rates are spread out). Few tasks cannot show non-inferiority at a small margin: with no
discordant task the pass/fail bound is ``-z^2 / (n + z^2)``, -0.18 at 12 tasks and -0.062 at 41
(z = 1.645), so a margin of 0.05 needs 52 tasks even when the two policies never disagree.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from statistics import NormalDist
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from coderl.online.monitors import Alarm, AlarmRule, check_alarms, default_alarm_rules


class GateConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    margins: dict[str, float] = Field(default_factory=lambda: {"pass@1": 0.05})
    """Non-inferiority margin per held-out metric (absolute, in the metric's units)."""
    alpha: float = Field(default=0.05, gt=0, lt=0.5)
    """One-sided level of the non-inferiority test (0.05: a 95 % lower confidence bound)."""
    behaviour_rules: list[AlarmRule] = Field(default_factory=default_alarm_rules)
    """Alarm rules applied to held-out behaviour (candidate vs champion)."""
    min_samples: int = Field(default=8, ge=1)
    """Fewest held-out episodes for a behaviour check to count."""


@dataclass
class MetricComparison:
    metric: str
    n: int
    champion_mean: float
    candidate_mean: float
    diff_mean: float
    diff_sd: float
    """Sample standard deviation of the paired differences (n - 1 in the denominator)."""
    method: str
    """``"paired-binary"`` (every score 0 or 1) or ``"student-t"`` (fractional scores)."""
    quantile: float
    """The quantile the bound uses: ``z_{1-alpha}`` (paired-binary) or ``t_{1-alpha, n-1}``."""
    bounds: dict[str, float]
    """The component lower bounds: ``newcombe10`` and ``tango`` (paired-binary; the gate uses
    the smaller) or ``t`` (student-t)."""
    sd_floor: float
    """Floor on ``diff_sd`` in the t bound (``resolution / sqrt(n)``; 0 for paired-binary or
    when the scores are on no grid)."""
    lower_bound: float
    margin: float
    passed: bool


@dataclass
class GateReport:
    promote: bool
    reasons: list[str] = field(default_factory=list)
    comparisons: list[MetricComparison] = field(default_factory=list)
    alarms: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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


def paired_noninferiority(
    metric: str, candidate: list[float], champion: list[float], *, margin: float, alpha: float
) -> MetricComparison:
    """Paired non-inferiority test of one metric on per-task scores.

    H0: the mean paired difference ``E[candidate_i - champion_i] <= -margin`` (the candidate is
    worse by the margin or more) is rejected, and the metric passes, when a one-sided
    ``1 - alpha`` lower confidence bound of the mean difference exceeds ``-margin``: the
    margin-shifted one-sided test (Wellek 2010, "Testing Statistical Hypotheses of Equivalence
    and Noninferiority", 2nd ed., Ch. 2; paired data in Ch. 5). The bound depends on the scores:

    - **Every score 0 or 1** (one pass/fail per task): the difference of paired proportions,
      bounded by :func:`paired_binary_lower` at ``z = z_{1-alpha}`` (the smaller of Newcombe's
      1998 method 10 and Tango's 1998 score bound). It stays valid with ties: with no
      discordant task it is ``-z^2 / (n + z^2)`` (-0.351 at 5 tasks), not 0.
    - **Otherwise** (pass rates over several samples per task): Student's t bound
      ``mean(d) - t_{1-alpha, n-1} * max(sd(d), h / sqrt(n)) / sqrt(n)`` on
      ``d_i = candidate_i - champion_i`` (Student 1908, "The probable error of a mean",
      Biometrika 6(1):1-25: exact for normal differences at every n), ``sd`` with ``n - 1`` in
      the denominator, ``h`` the scores' grid step (:func:`score_resolution`; ``1/k`` for pass
      rates over ``k`` samples). The floor ``h / sqrt(n)`` is the sd of n differences of which
      one is ``h`` and the rest 0: when every difference ties, the data cannot rule out a
      one-step disagreement on one task in n, so the bound is ``-t h / n`` rather than 0
      (-0.107 at 5 tasks of 4 samples). It stops the collapse at few tasks but remains
      optimistic for heavily tied pass rates at 12+ tasks (see the module docstring); scores on
      no grid (``h`` None) get no floor.

    Args:
        candidate, champion: per-task scores on the same tasks in the same order (floats, e.g.
            pass@1 per task in [0, 1]).
        margin: non-inferiority margin, in the metric's units (>= 0).
        alpha: one-sided level, in (0, 0.5).

    Raises:
        ValueError: different lengths, fewer than 2 tasks, a non-finite score, a negative margin
            or ``alpha`` outside (0, 0.5).
    """
    if len(candidate) != len(champion) or len(candidate) < 2:
        raise ValueError(
            f"{metric}: need equal paired scores on at least 2 tasks; got {len(candidate)} "
            f"candidate and {len(champion)} champion"
        )
    if not all(math.isfinite(x) for x in (*candidate, *champion)):
        raise ValueError(f"{metric}: scores must be finite numbers")
    if margin < 0 or not 0 < alpha < 0.5:
        raise ValueError(f"{metric}: need margin >= 0 and 0 < alpha < 0.5; got {margin}, {alpha}")
    n = len(candidate)
    d = [c - h for c, h in zip(candidate, champion, strict=True)]
    mean = sum(d) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
    floor = 0.0
    if all(x in (0, 1) for x in (*candidate, *champion)):
        method, q = "paired-binary", NormalDist().inv_cdf(1.0 - alpha)
        lower, bounds = paired_binary_lower(candidate, champion, q)
    else:
        method, q = "student-t", student_t_quantile(1.0 - alpha, n - 1)
        step = score_resolution([*candidate, *champion])
        floor = step / math.sqrt(n) if step is not None else 0.0
        lower = mean - q * max(sd, floor) / math.sqrt(n)
        bounds = {"t": lower}
    return MetricComparison(
        metric=metric,
        n=n,
        champion_mean=sum(champion) / n,
        candidate_mean=sum(candidate) / n,
        diff_mean=mean,
        diff_sd=sd,
        method=method,
        quantile=q,
        bounds=bounds,
        sd_floor=floor,
        lower_bound=lower,
        margin=margin,
        passed=lower > -margin,
    )


def run_gate(
    cfg: GateConfig,
    heldout: dict[str, tuple[list[float], list[float]]],
    behaviour: tuple[dict[str, float], dict[str, float]] | None,
    production_alarms: list[Alarm],
) -> GateReport:
    """Decide promotion.

    Args:
        heldout: ``{metric: (candidate_scores, champion_scores)}`` paired per task; every metric
            in ``cfg.margins`` must be present.
        behaviour: ``(champion_metrics, candidate_metrics)`` from held-out episodes, or None.
        production_alarms: alarms from the live monitors.

    Returns:
        a report whose ``promote`` is True only when every check passed; ``reasons`` lists
        every failed check.

    Raises:
        ValueError: a metric with a margin has no held-out scores, or its scores are not valid
            paired scores (see :func:`paired_noninferiority`).
    """
    missing = sorted(set(cfg.margins) - set(heldout))
    if missing:
        raise ValueError(f"held-out scores missing for gated metrics {missing}")
    rep = GateReport(promote=True)
    for metric, margin in sorted(cfg.margins.items()):
        cand, champ = heldout[metric]
        c = paired_noninferiority(metric, cand, champ, margin=margin, alpha=cfg.alpha)
        rep.comparisons.append(c)
        if not c.passed:
            rep.reasons.append(
                f"held-out {metric}: candidate {c.candidate_mean:.3f} vs champion "
                f"{c.champion_mean:.3f}, lower bound of the paired difference "
                f"{c.lower_bound:.3f} <= -margin {-margin:.3f} (n={c.n})"
            )
    alarms = list(production_alarms)
    if behaviour is not None:
        champ_m, cand_m = behaviour
        alarms += check_alarms(
            {"heldout": champ_m},
            {"heldout": cand_m},
            cfg.behaviour_rules,
            min_samples=cfg.min_samples,
        )
    for a in alarms:
        rep.alarms.append(a.reason())
        rep.reasons.append(a.reason())
    rep.promote = not rep.reasons
    return rep
