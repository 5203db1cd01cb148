"""The eval gate: a candidate replaces the champion only if it is not worse anywhere that counts.

Checks, all of which must pass:

1. **Held-out suites, paired**: each metric is scored per task for both policies on the same
   tasks; with differences ``d_i = candidate_i - champion_i`` the one-sided Student-t lower
   confidence bound ``mean(d) - t_{1-alpha, n-1} * sd(d) / sqrt(n)`` must exceed ``-margin``
   for that metric (the paired t-test of non-inferiority, H0: E[d] <= -margin; see
   :func:`paired_noninferiority`). Training reward plays no part: a candidate that raised it but
   breaches a held-out margin is rejected.
2. **Behaviour checks**: the candidate's behaviour metrics on the held-out episodes compared with
   the champion's under the alarm rules (edit rate, clarifying questions, broken calls...).
3. **Production monitors**: any alarm raised on live traffic blocks promotion.

Limits: the t bound is exact when the per-task differences are normal and close to it for the
bounded, roughly symmetric differences of pass rates; it is anti-conservative when nearly every
difference is the same value (binary outcomes with almost no discordant tasks: ``sd(d)`` is near
0 although a rare regression is plausible). With few tasks use several samples per task
(``eval.samples``) so that per-task scores are pass rates rather than 0/1.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
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
    t_quantile: float
    """``t_{1-alpha, n-1}``, the Student-t quantile the bound uses."""
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


def paired_noninferiority(
    metric: str, candidate: list[float], champion: list[float], *, margin: float, alpha: float
) -> MetricComparison:
    """Paired non-inferiority test of one metric: Student's one-sided t-test on the per-task
    differences ``d_i = candidate_i - champion_i``.

    H0: ``E[d] <= -margin`` (the candidate is worse by the margin or more) is rejected, and the
    metric passes, when the one-sided ``1 - alpha`` lower confidence bound
    ``mean(d) - t_{1-alpha, n-1} * sd(d) / sqrt(n)`` exceeds ``-margin``, ``sd`` with ``n - 1``
    in the denominator. Sources: Student (1908), "The probable error of a mean", Biometrika
    6(1):1-25 (``(mean - mu) / (sd / sqrt(n))`` follows t with ``n - 1`` degrees of freedom for
    normal data, at every n); the non-inferiority test as the margin-shifted one-sided test, i.e.
    a lower confidence bound compared with ``-margin``: Wellek (2010), "Testing Statistical
    Hypotheses of Equivalence and Noninferiority", 2nd ed., Ch. 2 (location-shift problems), with
    paired data reduced to the within-pair differences as in its Ch. 5. Unlike the normal bound it replaces
    (``z_{1-alpha}`` in place of ``t_{1-alpha, n-1}``), it accounts for the uncertainty of
    ``sd(d)``: at n = 5 the multiplier is 2.132, not 1.645.

    Args:
        candidate, champion: per-task scores on the same tasks in the same order (floats, e.g.
            pass@1 per task in [0, 1]).
        margin: non-inferiority margin, in the metric's units (>= 0).
        alpha: one-sided level, in (0, 0.5).

    Raises:
        ValueError: different lengths, fewer than 2 tasks (no variance estimate), a non-finite
            score, a negative margin or ``alpha`` outside (0, 0.5).
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
    q = student_t_quantile(1.0 - alpha, n - 1)
    lower = mean - q * sd / math.sqrt(n)
    return MetricComparison(
        metric=metric,
        n=n,
        champion_mean=sum(champion) / n,
        candidate_mean=sum(candidate) / n,
        diff_mean=mean,
        diff_sd=sd,
        t_quantile=q,
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
