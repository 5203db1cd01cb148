"""The learning curve of a run: held-out pass@k per evaluation with its 95% CI bands and the
collapse alarms marked, against the training signals that explain it (reward per term, the
resolved rate, the pool's active band, synthesis counts), as one data file and one picture.

Reads the rows of ``metrics.jsonl`` and the records of ``eval.jsonl`` (the periodic
evaluations of ``eval.every`` carry the ``collapse`` check that
:func:`coderl.train.heldout.log_eval_with_alarm` writes). Writes ``curve.json``
(:func:`curve_data`) and ``learning_curve.png`` (:func:`curve_figure`: four panels on one step
axis); the run report (:mod:`coderl.eval.report`) embeds both. Nothing is computed here: the
CIs are the evaluation's own (:func:`coderl.eval.passk.summarize`, percentile bootstrap over
tasks), the alarm is :func:`coderl.eval.passk.collapse_check`'s, every training value is the
logged one.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from coderl.metrics import reported  # noqa: E402

CURVE_JSON = "curve.json"
"""The curve's data, under the report directory."""
CURVE_PNG = "learning_curve.png"
"""The curve's picture, under the report directory."""
ALARM_COLOR = "tab:red"
ALARM_LABEL = "collapse alarm"
SIGNAL_KEY = "signal/groups_with_signal"
"""Share of a step's groups with non-zero reward variance (logged by the task pool's code)."""
ACTIVE_KEY = "pool/active"
"""Tasks of the pool whose pass-rate estimate is strictly between 0 and 1 (the active band,
:mod:`coderl.train.sampling`)."""
SYNTH_KEYS = ("synth/proposed", "synth/validated", "synth/admitted")
"""Tasks synthesised per step: proposed, validated in sandboxes, admitted to the pool
(:mod:`coderl.train.synth`)."""
SYNTH_TOTALS = ("synth/admitted_total", "synth/pool_tasks")
"""Tasks admitted so far, and the pool's size after the step."""
NOT_REWARD_TERMS = {"reward/mean", "reward/std", "reward/masked", "reward/grading_errors"} | {
    "reward/term_errors",
    "reward/term_timeouts",
}
"""``reward/*`` keys that are not reward terms (statistics and counts)."""


def reward_keys(metrics: list[dict[str, Any]]) -> list[str]:
    """``reward/mean`` and the per-term means (``reward/<term>``) the run logged, in that
    order; counts such as ``reward/masked`` are not terms."""
    terms = {k for r in metrics for k in r if k.startswith("reward/") and k.count("/") == 1}
    return ["reward/mean", *sorted(terms - NOT_REWARD_TERMS)]


def _number(v: Any) -> float | None:
    ok = isinstance(v, (int, float)) and not (isinstance(v, float) and math.isnan(v))
    return float(v) if ok else None


def curve_data(evals: list[dict[str, Any]], metrics: list[dict[str, Any]]) -> dict[str, Any]:
    """The curve as plain JSON data.

    Returns:
        ``evals``: one entry per evaluation: ``step``, ``phase`` (None for a periodic one),
        ``samples``, ``pass_at`` (``{k: {mean, lo, hi}}``, the 95% CI), ``alarm`` (True/False,
        None where no check ran: the first evaluation, the base model) and ``collapse_drop``;
        ``alarms``: the steps whose check raised the alarm; ``train``: ``step`` and, per logged
        key (reward mean and terms, ``resolved_rate``, :data:`ACTIVE_KEY`,
        :data:`SIGNAL_KEY`, :data:`SYNTH_KEYS`, :data:`SYNTH_TOTALS`), one value per step
        (None where a step did not log it or logged NaN).
    """
    rows = []
    for e in evals:
        c = e.get("collapse")
        rows.append(
            {
                "step": e["step"],
                "phase": e.get("phase"),
                "samples": e.get("samples"),
                "pass_at": e["pass_at"],
                "alarm": c["alarm"] if c else None,
                "collapse_drop": c["drop"] if c else None,
            }
        )
    keys = reward_keys(metrics) + ["resolved_rate", ACTIVE_KEY, SIGNAL_KEY]
    keys += [*SYNTH_KEYS, *SYNTH_TOTALS]
    logged = [k for k in keys if any(_number(r.get(k)) is not None for r in metrics)]
    train: dict[str, list[Any]] = {"step": [r["step"] for r in metrics]}
    train.update({k: [_number(r.get(k)) for r in metrics] for k in logged})
    return {"evals": rows, "alarms": [r["step"] for r in rows if r["alarm"]], "train": train}


def draw_passk(ax: Any, evals: list[dict[str, Any]]) -> None:
    """Held-out pass@k per evaluation on ``ax``: for each k a line over the evaluations from
    the start of RL on with its 95% CI as a band; the base model (before SFT, also at step 0)
    as its own point with its CI as an error bar, slightly left of step 0; each evaluation whose
    collapse check raised the alarm as a red cross on its pass@k (the check's k) and a dashed
    red line across the axis."""
    base = [e for e in evals if e.get("phase") == "base"]
    rest = [e for e in evals if e.get("phase") != "base"]
    for key in sorted({k for e in evals for k in e["pass_at"]}, key=int):
        pts = [(e["step"], e["pass_at"][key]) for e in rest if key in e["pass_at"]]
        if pts:
            x = [p[0] for p in pts]
            (line,) = ax.plot(x, [p[1]["mean"] for p in pts], marker="o", label=f"pass@{key}")
            lo, hi = [p[1]["lo"] for p in pts], [p[1]["hi"] for p in pts]
            ax.fill_between(x, lo, hi, color=line.get_color(), alpha=0.2)
        for e in base:
            if key in e["pass_at"]:
                est = e["pass_at"][key]
                ax.errorbar(
                    [-0.15],
                    [est["mean"]],
                    yerr=[[est["mean"] - est["lo"]], [est["hi"] - est["mean"]]],
                    fmt="s",
                    capsize=3,
                    label=f"pass@{key}, base model",
                )
    raised = [e for e in rest if (e.get("collapse") or {}).get("alarm")]
    for e in raised:
        k = str(e["collapse"]["k"])
        if k in e["pass_at"]:
            ax.plot([e["step"]], [e["pass_at"][k]["mean"]], "x", color=ALARM_COLOR, ms=10, mew=2)
    mark_alarms(ax, [e["step"] for e in raised], label=True)


def mark_alarms(ax: Any, steps: list[int], *, label: bool = False) -> None:
    """A dashed red vertical line at each step of ``steps`` (the legend names the first when
    ``label``)."""
    for i, s in enumerate(steps):
        name = ALARM_LABEL if label and i == 0 else None
        ax.axvline(s, color=ALARM_COLOR, linestyle="--", linewidth=1, label=name)


def _lines(ax: Any, train: dict[str, list[Any]], keys: list[str], empty: str) -> None:
    drawn = False
    for k in (k for k in keys if k in train):
        pts = [(s, v) for s, v in zip(train["step"], train[k], strict=True) if v is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, label=k)
            drawn = True
    if not drawn:
        ax.text(0.5, 0.5, empty, ha="center", va="center", transform=ax.transAxes, fontsize=8)


def curve_figure(data: dict[str, Any], evals: list[dict[str, Any]]) -> Figure:
    """The learning curve (:func:`curve_data`'s ``data``; ``evals``: the ``eval.jsonl``
    records it came from), four panels on one integer step axis: held-out pass@k with CI bands
    (:func:`draw_passk`); training reward, mean and per term, and the resolved rate; the active
    band (:data:`ACTIVE_KEY`); synthesis per step (:data:`SYNTH_KEYS`). Every panel marks the
    collapse alarms with a dashed red line; a panel the run logged nothing for says so."""
    fig, axes = plt.subplots(4, 1, figsize=(7, 10), sharex=True)
    train, alarms = data["train"], data["alarms"]
    titles = [
        "Held-out pass@k (95% CI bands; red: collapse alarm)",
        "Training reward (mean, per term) and resolved rate",
        "Active band: pool tasks with 0 < pass-rate estimate < 1",
        "Synthesis per step (tasks)",
    ]
    draw_passk(axes[0], evals)
    axes[0].set_ylabel("pass@k (held-out)")
    terms = [k for k in train if k.startswith("reward/")] + ["resolved_rate"]
    _lines(axes[1], train, terms, "no reward logged")
    _lines(axes[2], train, [ACTIVE_KEY], f"no pool: {ACTIVE_KEY} not logged by this run")
    _lines(axes[3], train, list(SYNTH_KEYS), "synthesis off: no synth/* logged by this run")
    for ax, title in zip(axes, titles, strict=True):
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
        if ax is not axes[0]:
            mark_alarms(ax, alarms)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6)
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    return fig


def write_curve(
    out: str | Path, evals: list[dict[str, Any]], metrics: list[dict[str, Any]]
) -> dict[str, Any]:
    """Write ``out/curve.json`` and ``out/learning_curve.png``; returns the data written
    (:func:`curve_data`).

    Raises:
        ValueError: ``evals`` is empty (no curve without a held-out evaluation).
    """
    if not evals:
        raise ValueError("no held-out evaluation: the learning curve needs eval.jsonl records")
    out = Path(out)
    data = curve_data(evals, metrics)
    (out / CURVE_JSON).write_text(json.dumps(reported(data), indent=1) + "\n")
    fig = curve_figure(data, evals)
    fig.savefig(out / CURVE_PNG, dpi=90)
    plt.close(fig)
    return data


def alarm_caption(data: dict[str, Any]) -> str:
    """One sentence on the alarms the curve marks: the steps where the alarm was raised, that
    it never was in N checks, or that no check ran (no periodic evaluation)."""
    checks = [e for e in data["evals"] if e["alarm"] is not None]
    if not checks:
        return "collapse alarm: not checked (no evaluation during RL after the first)"
    if data["alarms"]:
        steps = ", ".join(str(s) for s in data["alarms"])
        return f"collapse alarm RAISED at step {steps} of {len(checks)} checks (marked in red)"
    return f"collapse alarm not raised in {len(checks)} checks"
