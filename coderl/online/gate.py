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
4. **Suspected hacks**: a rise of the held-out ``suspected_hack_rate`` (the share of episodes a
   hack detector flags) from champion to candidate by more than ``gate.hack_rate_margin`` blocks
   promotion, reported as an alarm.
5. **No gain anywhere**: a candidate that is worse than the champion on some held-out task and
   better on none (for any gated metric) is rejected, however small the loss: it has shown
   nothing to trade the loss for. When both score 0 on every task for every gated metric (0.000
   vs 0.000: nothing measured) the candidate is rejected too (:func:`no_evidence`).
6. **The best earlier champion**: the paired test (1) and check (5) are run again against the
   earlier champion of the track with the best recorded held-out mean, so a run of candidates
   each within the margin of its parent cannot drift further than one margin from the best
   policy the track has served (five promotions each 0.04 worse would otherwise compound to
   0.2).
7. **Gameable learned grader**: when ``reward.terms`` names a learned grader (``judge``,
   ``rm``), the gameability probes (:mod:`coderl.graders.probes`) run on the candidate's held-out
   replies; a probe that reliably raises the grader's score (:func:`~coderl.graders.probes.
   probe_gate`) blocks promotion, reported as an alarm.

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

from coderl.config.online import AlarmRule, GateConfig
from coderl.online.monitors import SUSPECTED_HACK_RATE, Alarm, check_alarms
from coderl.stats import paired_binary_lower, paired_t_lower, score_resolution, student_t_quantile


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
      bounded by :func:`coderl.stats.paired_binary_lower` at ``z = z_{1-alpha}`` (the smaller of Newcombe's
      1998 method 10 and Tango's 1998 score bound). It stays valid with ties: with no
      discordant task it is ``-z^2 / (n + z^2)`` (-0.351 at 5 tasks), not 0.
    - **Otherwise** (pass rates over several samples per task): Student's t bound
      ``mean(d) - t_{1-alpha, n-1} * max(sd(d), h / sqrt(n)) / sqrt(n)`` on
      ``d_i = candidate_i - champion_i`` (Student 1908, "The probable error of a mean",
      Biometrika 6(1):1-25: exact for normal differences at every n), ``sd`` with ``n - 1`` in
      the denominator, ``h`` the scores' grid step (:func:`coderl.stats.score_resolution`; ``1/k`` for pass
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
        lower = paired_t_lower(d, q, floor)
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


def hack_rate_alarm(champion: float, candidate: float, *, margin: float) -> Alarm | None:
    """An alarm when the suspected-hack rate rose by more than ``margin`` (absolute): the
    rule ``suspected_hack_rate rise > margin``, with no minimum sample size (a detector's flag is
    evidence on its own, and a rise is never traded against a gain in reward).

    Raises:
        ValueError: a rate outside [0, 1] (NaN included) or a negative margin.
    """
    if not (0 <= champion <= 1 and 0 <= candidate <= 1) or not margin >= 0:
        raise ValueError(
            f"hack rates must be in [0, 1] and the margin >= 0; got champion {champion}, "
            f"candidate {candidate}, margin {margin}"
        )
    if candidate - champion <= margin:
        return None
    rule = AlarmRule(metric=SUSPECTED_HACK_RATE, direction="rise", threshold=margin)
    return Alarm(rule, "heldout", champion, candidate)


def no_gain(metric: str, candidate: list[float], champion: list[float]) -> str | None:
    """Why the candidate shows no gain on ``metric`` (worse on some task, better on none), or
    None. Paired per-task scores as :func:`paired_noninferiority`."""
    d = [c - h for c, h in zip(candidate, champion, strict=True)]
    worse, better = sum(x < 0 for x in d), sum(x > 0 for x in d)
    if worse and not better:
        return f"worse on {worse} of {len(d)} tasks and better on none"
    return None


def no_evidence(heldout: dict[str, tuple[list[float], list[float]]]) -> str | None:
    """Why the held-out suites measured nothing (every gated metric scores 0 for candidate and
    champion on every task: a suite neither policy scores on, or no task at all), or None.
    0.000 vs 0.000 passes the non-inferiority test trivially (no discordant task); promoting on
    it would replace the champion on no evidence."""
    if any(x != 0 for pair in heldout.values() for side in pair for x in side):
        return None
    n = max((len(c) for c, _ in heldout.values()), default=0)
    return (
        f"not measured: candidate and champion both score 0.000 on all {n} held-out tasks "
        f"({', '.join(sorted(heldout))}); nothing shows either is better, not promoted"
    )


def _compare(
    cfg: GateConfig, heldout: dict[str, tuple[list[float], list[float]]], rep: GateReport, who: str
) -> list[str]:
    """The paired test and the no-gain check of every gated metric against one champion: the
    comparisons go into ``rep``; returns one reason per failed metric (both checks' failures
    in one line, so a metric is never two rows of a report)."""
    missing = sorted(set(cfg.margins) - set(heldout))
    if missing:
        raise ValueError(f"held-out scores missing for gated metrics {missing}")
    prefix = "" if who == "champion" else "best/"
    reasons = []
    for metric, margin in sorted(cfg.margins.items()):
        cand, champ = heldout[metric]
        c = paired_noninferiority(metric, cand, champ, margin=margin, alpha=cfg.alpha)
        c.metric = prefix + metric
        rep.comparisons.append(c)
        failed = []
        if not c.passed:
            bound = f"{c.lower_bound:.3f} <= -margin {-margin:.3f} (n={c.n})"
            failed.append(f"lower bound of the paired difference {bound}")
        if (why := no_gain(metric, cand, champ)) is not None:
            failed.append(why)
        if failed:
            reasons.append(
                f"held-out {metric}: candidate {c.candidate_mean:.3f} vs {who} "
                f"{c.champion_mean:.3f}, {'; '.join(failed)}"
            )
    return reasons


def run_gate(
    cfg: GateConfig,
    heldout: dict[str, tuple[list[float], list[float]]],
    behaviour: tuple[dict[str, float], dict[str, float]] | None,
    production_alarms: list[Alarm],
    hack_rates: tuple[float, float] | None = None,
    probes: dict[str, tuple[bool, str]] | None = None,
    best: dict[str, tuple[list[float], list[float]]] | None = None,
) -> GateReport:
    """Decide promotion.

    Args:
        heldout: ``{metric: (candidate_scores, champion_scores)}`` paired per task; every metric
            in ``cfg.margins`` must be present.
        behaviour: ``(champion_metrics, candidate_metrics)`` from held-out episodes, or None.
        production_alarms: alarms from the live monitors.
        hack_rates: ``(champion, candidate)`` suspected-hack rates in [0, 1] on the held-out
            episodes, or None (no detector ran); see :func:`hack_rate_alarm`.
        probes: learned term -> :func:`coderl.graders.probes.probe_gate` of its probes, or
            None (no learned grader configured); a failed one is an alarm.
        best: ``{metric: (candidate_scores, best_scores)}`` against the best earlier champion
            (check 6; metric names get the prefix ``best/`` in the report), or None when the
            current champion is the best (or the only) one.

    Returns:
        a report whose ``promote`` is True only when every check passed; ``reasons`` lists
        every failed check.

    Raises:
        ValueError: a metric with a margin has no held-out scores, or its scores are not valid
            paired scores (see :func:`paired_noninferiority`); a hack rate outside [0, 1].
    """
    rep = GateReport(promote=True)
    failed = _compare(cfg, heldout, rep, "champion")
    same = no_evidence({m: heldout[m] for m in cfg.margins})
    rep.reasons += failed if same is None else [same]  # 0.000 vs 0.000 failed no test: unmeasured
    if best is not None:
        rep.reasons += _compare(cfg, best, rep, "best earlier champion")
    alarms = list(production_alarms)
    if behaviour is not None:
        champ_m, cand_m = behaviour
        alarms += check_alarms(
            {"heldout": champ_m},
            {"heldout": cand_m},
            cfg.behaviour_rules,
            min_samples=cfg.min_samples,
        )
    if hack_rates is not None:
        alarm = hack_rate_alarm(*hack_rates, margin=cfg.hack_rate_margin)
        alarms += [alarm] if alarm is not None else []
    reasons = [a.reason() for a in alarms]
    reasons += [
        f"alarm: learned grader {n}: {why}" for n, (ok, why) in (probes or {}).items() if not ok
    ]
    for r in reasons:
        rep.alarms.append(r)
        rep.reasons.append(r)
    rep.promote = not rep.reasons
    return rep


def run_population_gate(
    cfg: GateConfig,
    own: dict[str, tuple[list[float], list[float]]],
    shared: dict[str, tuple[list[float], list[float]]],
    behaviour: tuple[dict[str, float], dict[str, float]] | None,
    production_alarms: list[Alarm],
    hack_rates: tuple[float, float] | None = None,
    probes: dict[str, tuple[bool, str]] | None = None,
    best: dict[str, tuple[list[float], list[float]]] | None = None,
) -> GateReport:
    """Decide a population's promotion: :func:`run_gate` on its own held-out suite against
    the version it is served (every check of :func:`run_gate`, at ``cfg.margins``), and the
    paired non-inferiority test on the shared suite against the shared champion (at
    ``cfg.shared_margins``, default ``cfg.margins``), so a candidate that fits its organisation
    but forgets what every organisation needs is rejected. Promote only when both pass.

    Args:
        own, shared: ``{metric: (candidate_scores, champion_scores)}`` paired per task on the
            population's suite and on the shared suite.
        behaviour, production_alarms, hack_rates, probes, best: as :func:`run_gate`, for the
            population's own suite and traffic.

    Returns:
        one report: the own suite's comparisons, then the shared suite's (metric names
        prefixed ``shared/``); ``reasons`` of the shared suite start with ``shared suite:``.

    Raises:
        ValueError: as :func:`run_gate`, for either suite.
    """
    rep = run_gate(cfg, own, behaviour, production_alarms, hack_rates, probes, best)
    margins = cfg.margins if cfg.shared_margins is None else cfg.shared_margins
    srep = run_gate(cfg.model_copy(update={"margins": margins}), shared, None, [])
    for c in srep.comparisons:
        c.metric = f"shared/{c.metric}"
    rep.comparisons += srep.comparisons
    rep.reasons += [f"shared suite: {r}" for r in srep.reasons]
    rep.promote = not rep.reasons
    return rep
