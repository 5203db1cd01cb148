"""The eval gate: a candidate replaces the champion only if it is not worse anywhere that counts.

Checks, all of which must pass:

1. **Held-out suites, paired**: each metric is scored per task for both policies on the same
   tasks; with differences ``d_i = candidate_i - champion_i`` the one-sided lower confidence bound
   ``mean(d) - z * sd(d) / sqrt(n)`` must exceed ``-margin`` for that metric (a non-inferiority
   test on paired differences with a normal approximation; Wellek 2010, "Testing Statistical
   Hypotheses of Equivalence and Noninferiority", Ch. 5). Training reward plays no part: a
   candidate that raised it but breaches a held-out margin is rejected.
2. **Behaviour checks**: the candidate's behaviour metrics on the held-out episodes compared with
   the champion's under the alarm rules (edit rate, clarifying questions, broken calls...).
3. **Production monitors**: any alarm raised on live traffic blocks promotion.

Limits: the normal approximation is loose for very few tasks (n < ~20); pick margins accordingly.
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
    z: float = Field(default=1.645, gt=0)
    """Normal quantile of the one-sided bound (1.645: 95 % confidence)."""
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


def paired_noninferiority(
    metric: str, candidate: list[float], champion: list[float], *, margin: float, z: float
) -> MetricComparison:
    """Paired non-inferiority test of one metric (see module docstring).

    Args:
        candidate, champion: per-task scores on the same tasks in the same order.

    Raises:
        ValueError: different lengths or no tasks.
    """
    if len(candidate) != len(champion) or not candidate:
        raise ValueError(
            f"{metric}: need equal, non-empty paired scores; got {len(candidate)} candidate and "
            f"{len(champion)} champion"
        )
    n = len(candidate)
    d = [c - h for c, h in zip(candidate, champion, strict=True)]
    mean = sum(d) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1)) if n > 1 else 0.0
    lower = mean - z * sd / math.sqrt(n)
    return MetricComparison(
        metric=metric,
        n=n,
        champion_mean=sum(champion) / n,
        candidate_mean=sum(candidate) / n,
        diff_mean=mean,
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
        ValueError: a metric with a margin has no held-out scores.
    """
    missing = sorted(set(cfg.margins) - set(heldout))
    if missing:
        raise ValueError(f"held-out scores missing for gated metrics {missing}")
    rep = GateReport(promote=True)
    for metric, margin in sorted(cfg.margins.items()):
        cand, champ = heldout[metric]
        c = paired_noninferiority(metric, cand, champ, margin=margin, z=cfg.z)
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
