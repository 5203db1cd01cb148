"""Report pieces for learned graders: per-criterion judge scores over training steps, agreement
of a grader with the tests, probe shifts, and an HTML section for :mod:`coderl.eval.report`.

Agreement on episodes that have tests: accuracy of ``score >= threshold`` against ``resolved``,
with Wilson's 95% interval (:func:`coderl.stats.wilson_interval`), and Spearman's rank correlation
between scores and outcomes (Spearman 1904, "The proof and measurement of association between two
things"; Pearson correlation of mid-ranks, ties averaged) via ``scipy.stats.spearmanr`` when SciPy
is installed, else :func:`spearman` here.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from coderl.graders.probes import ProbeResult
from coderl.metrics import reported
from coderl.stats import wilson_interval


def _ranks(x: Sequence[float]) -> list[float]:
    """Mid-ranks (1-based; tied values share the mean of their ranks)."""
    order = sorted(range(len(x)), key=lambda i: x[i])
    ranks = [0.0] * len(x)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rho: Pearson correlation of mid-ranks; NaN when either side is constant or
    fewer than 2 points.

    Raises:
        ValueError: ``x`` and ``y`` differ in length.
    """
    if len(x) != len(y):
        raise ValueError(f"spearman: {len(x)} vs {len(y)} values")
    if len(x) < 2:
        return math.nan
    rx, ry = _ranks(x), _ranks(y)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    sxx = sum((a - mx) ** 2 for a in rx)
    syy = sum((b - my) ** 2 for b in ry)
    return math.nan if sxx == 0 or syy == 0 else sxy / math.sqrt(sxx * syy)


def _spearman(x: Sequence[float], y: Sequence[float]) -> float:
    try:
        from scipy.stats import spearmanr
    except ImportError:
        return spearman(x, y)
    if len(x) < 2 or len(set(x)) < 2 or len(set(y)) < 2:
        return math.nan
    return float(spearmanr(x, y).statistic)


def agreement_with_tests(
    scores: Sequence[float], resolved: Sequence[bool], *, threshold: float = 0.5
) -> dict[str, float]:
    """How well a grader's scores agree with the tests, on the episodes it did not mask.

    Returns:
        ``n``, ``masked``, ``accuracy`` (of ``score >= threshold`` vs resolved) with ``acc_lo`` /
        ``acc_hi`` (Wilson 95%), ``spearman`` (rank correlation of score and resolved).

    Raises:
        ValueError: different lengths.
    """
    if len(scores) != len(resolved):
        raise ValueError(f"{len(scores)} scores but {len(resolved)} outcomes")
    kept = [(s, bool(r)) for s, r in zip(scores, resolved, strict=True) if math.isfinite(s)]
    n = len(kept)
    out = {"n": float(n), "masked": float(len(scores) - n)}
    if not n:
        return {**out, "accuracy": math.nan, "acc_lo": math.nan, "acc_hi": math.nan,
                "spearman": math.nan}  # fmt: skip
    k = sum((s >= threshold) == r for s, r in kept)
    lo, hi = wilson_interval(k, n, 1.959964)
    rho = _spearman([s for s, _ in kept], [float(r) for _, r in kept])
    return {
        **out,
        "accuracy": k / n,
        "acc_lo": max(lo, 0.0),
        "acc_hi": min(hi, 1.0),
        "spearman": rho,
    }


def criteria_over_steps(
    rows: Sequence[dict[str, Any]], prefix: str = "reward/judge/"
) -> dict[str, tuple[list[int], list[float]]]:
    """Per-criterion series from metric rows (``{"step": int, "reward/judge/<c>": float}``):
    criterion -> (steps, values), NaN rows skipped."""
    out: dict[str, tuple[list[int], list[float]]] = {}
    for r in rows:
        for k, v in r.items():
            if k.startswith(prefix) and isinstance(v, int | float) and math.isfinite(v):
                s, vals = out.setdefault(k[len(prefix) :], ([], []))
                s.append(int(r["step"]))
                vals.append(float(v))
    return out


def probe_table(results: Sequence[ProbeResult]) -> str:
    """An HTML table of probe shifts (flagged rows marked)."""
    rows = "".join(
        f"<tr><td>{html.escape(r.probe)}</td><td>{r.n}</td><td>{r.masked}</td>"
        f"<td>{r.mean:+.3f}</td><td>[{r.lo:+.3f}, {r.hi:+.3f}]</td>"
        f"<td>{'RAISES SCORE' if r.flagged else ''}</td></tr>"
        for r in results
    )
    head = "<tr><th>probe</th><th>n</th><th>masked</th><th>mean shift</th><th>95% CI</th><th></th></tr>"
    return f"<table>{head}{rows}</table>"


def write_probe_results(path: str | Path, grader: str, results: Sequence[ProbeResult]) -> None:
    """Append one JSON line per probe result (with the grader's name) to ``path``."""
    with Path(path).open("a") as f:
        for r in results:
            f.write(json.dumps(reported({"grader": grader, **asdict(r)})) + "\n")


def criteria_metrics(
    breakdowns: Sequence[dict[str, float]], valid: Sequence[bool], prefix: str = "judge/"
) -> dict[str, float]:
    """Step metrics ``reward/judge/<criterion>``: the mean over valid samples of each
    per-criterion score in the reward breakdown (what the training loop should log)."""
    sums: dict[str, list[float]] = {}
    for b, ok in zip(breakdowns, valid, strict=True):
        for k, v in b.items():
            if ok and k.startswith(prefix) and math.isfinite(v):
                sums.setdefault(k, []).append(v)
    return {f"reward/{k}": sum(v) / len(v) for k, v in sums.items()}


def html_section(out_dir: str | Path, rows: Sequence[dict[str, Any]], probes: str | Path) -> str:
    """The graders' part of a run report: a PNG of per-criterion judge scores over steps
    (``out_dir/graders_criteria.png``) when the metric rows have any, and the probe tables of
    the ``probes`` JSONL file (:func:`write_probe_results`); empty when there is neither."""
    run = Path(out_dir)
    parts = []
    series = criteria_over_steps(rows)
    if series:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        for name, (s, v) in sorted(series.items()):
            ax.plot(s, v, marker="o", label=name)
        ax.set(xlabel="step", ylabel="judge score (0-1)", title="Judge criteria")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(run / "graders_criteria.png", dpi=100)
        plt.close(fig)
        parts.append('<img src="graders_criteria.png" alt="judge criteria over steps">')
    probes = Path(probes)
    if probes.is_file():
        by: dict[str, list[ProbeResult]] = {}
        for line in probes.read_text().splitlines():
            d = json.loads(line)
            by.setdefault(d.pop("grader"), []).append(ProbeResult(**d))
        for g, res in by.items():
            parts.append(f"<h3>Probes: {html.escape(g)}</h3>{probe_table(res)}")
    return "<h2>Learned graders</h2>" + "".join(parts) if parts else ""
