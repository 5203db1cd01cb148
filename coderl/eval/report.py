"""``coderl report RUN_DIR``: PNG plots and one HTML page from a run's ``metrics.jsonl`` and
``eval.jsonl``, and the audit page of the top-reward and flagged trajectories from
``audit.jsonl`` (:mod:`coderl.eval.audit`). Uses matplotlib's Agg backend (no display needed).

The page opens with the run's summary (:func:`coderl.eval.summary.summary_lines`: pass@1 per
evaluation phase, the paired RL-only change, pass@k at the largest k before/after RL, broken
calls before/after, the same rows for each split of ``eval.extra_splits``, phase times), then held-out pass@k per evaluation with 95% CI bands (collapse
alarms marked), the learning curve (:mod:`coderl.eval.curve`: ``learning_curve.png`` and
``curve.json``), and the training curves: reward (mean and per term), resolved rate, groups with signal (the share of
groups whose rewards vary, ``signal/groups_with_signal``, when the run logged it), the task
pool's scalars (``pool/*``, when logged), KL, entropy, length, broken calls, time split. Every
step axis has integer ticks.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from coderl.eval.audit import write_audit_page  # noqa: E402
from coderl.eval.curve import (  # noqa: E402
    CURVE_JSON,
    CURVE_PNG,
    SIGNAL_KEY,
    alarm_caption,
    draw_passk,
    reward_keys,
    write_curve,
)
from coderl.eval.summary import (  # noqa: E402
    parsed_calls,
    phase_name,
    read_extra_evals,
    read_phases,
    summary_lines,
)
from coderl.graders.report import html_section  # noqa: E402
from coderl.metrics import SFT_LOG, read_jsonl  # noqa: E402

# plot file -> (title, metric keys drawn on it); the one list of what the report shows. A plot
# in OPTIONAL is drawn only when the run logged one of its keys.
PLOTS: dict[str, tuple[str, list[str]]] = {
    "reward.png": ("Reward (mean and per term)", ["reward/mean"]),
    "resolved.png": ("Resolved rate (training episodes)", ["resolved_rate"]),
    "signal.png": ("Groups with signal (share with non-zero reward variance)", [SIGNAL_KEY]),
    "pool.png": ("Task pool", []),
    "kl.png": ("KL to the reference and approx. KL(old || new)", ["kl", "approx_kl"]),
    "entropy.png": ("Entropy (nats / token)", ["entropy"]),
    "length.png": ("Episode length (sampled tokens)", ["episode/sampled_tokens"]),
    "broken_calls.png": (
        "Broken tool calls and no-action turns per episode",
        [
            "episode/broken_tool_calls",
            "episode/no_action_turns",
        ],
    ),
    "time.png": ("Time split per step (s)", ["time/rollout", "time/grading", "time/train"]),
}
OPTIONAL = {"signal.png", "pool.png", "kl.png"}  # kl: absent unless measured
HELDOUT = ("heldout.png", "Held-out pass@k per evaluation (95% CI bands)")
SFT_PLOT = ("sft.png", "SFT warm start: NLL per assistant token, per batch")


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


def _figure(title: str) -> tuple[Figure, Any]:
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    ax.grid(alpha=0.3)
    return fig, ax


def _save(fig: Figure, ax: Any, path: Path) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _plot(path: Path, title: str, lines: dict[str, tuple[list[int], list[float]]]) -> None:
    fig, ax = _figure(title)
    for label, (x, y) in lines.items():
        ax.plot(x, y, marker="o", markersize=3, label=label)
    _save(fig, ax, path)


def heldout_figure(evals: list[dict[str, Any]]) -> tuple[Figure, Any]:
    """Held-out pass@k per evaluation with 95% CI bands, the base model as its own point and
    the collapse alarms marked (:func:`coderl.eval.curve.draw_passk`)."""
    fig, ax = _figure(HELDOUT[1])
    draw_passk(ax, evals)
    ax.set_ylabel("pass@k (held-out)")
    return fig, ax


def _summary_rows(evals: list[dict[str, Any]]) -> str:
    rows = []
    for i, e in enumerate(evals):
        cells = [f"{e['step']} ({phase_name(e, i == len(evals) - 1)})"]
        for k, est in sorted(e["pass_at"].items(), key=lambda kv: int(kv[0])):
            cells.append(f"pass@{k} {est['mean']:.3f} [{est['lo']:.3f}, {est['hi']:.3f}]")
        b = e.get("best_of_n")
        if b:
            cells.append(f"best-of-{e['samples']} {b['mean']:.3f} [{b['lo']:.3f}, {b['hi']:.3f}]")
        c = e.get("collapse")
        if c:
            alarm = "COLLAPSE ALARM" if c["alarm"] else "no collapse alarm"
            change = c["change"]["mean"]
            cells.append(f"{alarm}: pass@{c['k']} {change:+.3f} vs step {c['best_step']}")
        if "broken_calls" in e and (not e.get("per_task") or parsed_calls(e)):  # measured
            cells.append(
                f"broken calls/episode {e['broken_calls']:.2f} "
                f"({e['broken_episode_rate']:.0%} of episodes)"
            )
        rows.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    return "\n".join(rows)


def _key_table(rows: list[tuple[str, str]]) -> str:
    return "\n".join(
        f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in rows
    )


def write_report(run_dir: str | Path) -> Path:
    """Write ``RUN_DIR/report/*.png``, ``RUN_DIR/report/index.html`` and, when the run kept
    trajectories, ``RUN_DIR/report/audit.html``; returns the index page.

    Raises:
        FileNotFoundError: ``run_dir`` does not exist, or has neither ``metrics.jsonl`` nor
            ``eval.jsonl``.
    """
    run = Path(run_dir)
    if run.is_file():
        raise FileNotFoundError(
            f"{run} is a file, not a run directory (a config? `coderl train {run}` makes a run "
            "to report on)"
        )
    if not run.is_dir():
        raise FileNotFoundError(f"{run} does not exist (give a run directory)")
    metrics, evals = read_jsonl(run / "metrics.jsonl"), read_jsonl(run / "eval.jsonl")
    sft = read_jsonl(run / SFT_LOG)
    if not metrics and not evals and not sft:
        raise FileNotFoundError(f"{run}: no metrics.jsonl, eval.jsonl or {SFT_LOG} to report on")
    out = run / "report"
    out.mkdir(exist_ok=True)
    images = []
    if sft:
        _plot(out / SFT_PLOT[0], SFT_PLOT[1], {"nll": _series(sft, "nll")})
        images.append(SFT_PLOT)
    for name, (title, keys) in PLOTS.items() if metrics else ():  # none for SFT alone
        if name == "reward.png":
            keys = reward_keys(metrics)
        if name == "pool.png":
            keys = sorted(
                {k for r in metrics for k, v in r.items() if k.startswith("pool/")}
                - {k for r in metrics for k, v in r.items() if not isinstance(v, (int, float))}
            )
        if name in OPTIONAL and not any(_series(metrics, k)[0] for k in keys):
            continue
        _plot(out / name, title, {k: _series(metrics, k) for k in keys})
        images.append((name, title))
    curve = ""
    if evals:
        fig, ax = heldout_figure(evals)
        _save(fig, ax, out / HELDOUT[0])
        images.insert(0, HELDOUT)
        caption = html.escape(alarm_caption(write_curve(out, evals, metrics)))
        curve = (
            f'<h2>Learning curve</h2>\n<figure><img src="{CURVE_PNG}" alt="learning curve">'
            f"<figcaption>Held-out pass@k with 95% CI bands, training reward per term, active "
            f"band and synthesis per step; {caption}. Data: "
            f'<a href="{CURVE_JSON}">{CURVE_JSON}</a></figcaption></figure>'
        )
    figs = "\n".join(
        f'<figure><img src="{n}" alt="{html.escape(t)}"><figcaption>{html.escape(t)}'
        "</figcaption></figure>"
        for n, t in images
    )
    audit = write_audit_page(run)
    audit_link = (
        '<p><a href="audit.html">Audit: top-reward and flagged trajectories</a></p>'
        if audit
        else ""
    )
    last = metrics[-1] if metrics else {}
    summary = _key_table(summary_lines(evals, metrics, read_phases(run), read_extra_evals(run)))
    signal = (
        ""
        if any(SIGNAL_KEY in r for r in metrics)
        else f"<p>Groups with signal: not logged by this run (<code>{SIGNAL_KEY}</code>).</p>"
    )
    graders = html_section(out, metrics, run / "probes.jsonl")  # empty without learned graders
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>coderl run {html.escape(run.name)}</title>
<style>body{{font-family:sans-serif;margin:2em}}figure{{display:inline-block;margin:0.5em}}
td,th{{padding:0.2em 0.8em;border-bottom:1px solid #ddd;text-align:left}}</style></head><body>
<h1>coderl run: {html.escape(str(run))}</h1>
<p>{len(metrics)} training steps logged; last step {last.get("step", "-")}.</p>
{audit_link}
<h2>Summary</h2>
<table>{summary or "<tr><td>no evaluation logged</td></tr>"}</table>
<h2>Held-out evaluation (95% bootstrap CIs over tasks)</h2>
<table>{_summary_rows(evals) or "<tr><td>no evaluation logged</td></tr>"}</table>
{curve}
<h2>Training curves</h2>
{signal}
{figs}
{graders}
</body></html>
"""
    index = out / "index.html"
    index.write_text(page)
    return index
