"""``coderl report RUN_DIR``: PNG plots and one HTML page from a run's ``metrics.jsonl`` and
``eval.jsonl`` (reward, held-out pass@1, best-of-n, KL, entropy, length, broken calls, time
split), and the audit page of the top-reward and flagged trajectories from ``audit.jsonl``
(:mod:`coderl.eval.audit`). Uses matplotlib's Agg backend (no display needed)."""

from __future__ import annotations

import argparse
import html
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from coderl.eval.audit import write_audit_page  # noqa: E402
from coderl.graders.report import html_section  # noqa: E402
from coderl.train.metrics import read_jsonl  # noqa: E402

# plot file -> (title, metric keys drawn on it); the one list of what the report shows
PLOTS: dict[str, tuple[str, list[str]]] = {
    "reward.png": ("Reward (mean and per term)", ["reward/mean"]),
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


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def _plot(path: Path, title: str, lines: dict[str, tuple[list[int], list[float]]]) -> None:
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for label, (x, y) in lines.items():
        ax.plot(x, y, marker="o", markersize=3, label=label)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    if lines:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _eval_lines(evals: list[dict[str, Any]]) -> dict[str, tuple[list[int], list[float]]]:
    out: dict[str, tuple[list[int], list[float]]] = {}
    for key in sorted({k for e in evals for k in e["pass_at"]}, key=int):
        pts = [(e["step"], e["pass_at"][key]["mean"]) for e in evals if key in e["pass_at"]]
        out[f"pass@{key}"] = ([p[0] for p in pts], [p[1] for p in pts])
    pts = [(e["step"], e["best_of_n"]["mean"]) for e in evals if e.get("best_of_n")]
    if pts:
        out[f"best-of-{evals[0]['samples']}"] = ([p[0] for p in pts], [p[1] for p in pts])
    return out


def _summary_rows(evals: list[dict[str, Any]]) -> str:
    rows = []
    for e in evals:
        cells = [str(e["step"]) + (f" ({e['phase']})" if e.get("phase") else "")]
        for k, est in sorted(e["pass_at"].items(), key=lambda kv: int(kv[0])):
            cells.append(f"pass@{k} {est['mean']:.3f} [{est['lo']:.3f}, {est['hi']:.3f}]")
        b = e.get("best_of_n")
        if b:
            cells.append(f"best-of-{e['samples']} {b['mean']:.3f} [{b['lo']:.3f}, {b['hi']:.3f}]")
        rows.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    return "\n".join(rows)


def write_report(run_dir: str | Path) -> Path:
    """Write ``RUN_DIR/report/*.png``, ``RUN_DIR/report/index.html`` and, when the run kept
    trajectories, ``RUN_DIR/report/audit.html``; returns the index page.

    Raises:
        FileNotFoundError: ``run_dir`` has neither ``metrics.jsonl`` nor ``eval.jsonl``.
    """
    run = Path(run_dir)
    metrics, evals = read_jsonl(run / "metrics.jsonl"), read_jsonl(run / "eval.jsonl")
    if not metrics and not evals:
        raise FileNotFoundError(f"{run}: no metrics.jsonl or eval.jsonl to report on")
    out = run / "report"
    out.mkdir(exist_ok=True)
    images = []
    for name, (title, keys) in PLOTS.items():
        if name == "reward.png":
            keys = keys + sorted(
                {k for r in metrics for k in r if k.startswith("reward/") and k.count("/") == 1}
                - {"reward/mean", "reward/std", "reward/masked", "reward/grading_errors"}
                - {"reward/term_errors", "reward/term_timeouts"}
            )
        _plot(out / name, title, {k: _series(metrics, k) for k in keys})
        images.append((name, title))
    if evals:
        _plot(out / "heldout.png", "Held-out pass@k and best-of-n", _eval_lines(evals))
        images.insert(0, ("heldout.png", "Held-out pass@k and best-of-n"))
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
    graders = html_section(out, metrics, run / "probes.jsonl")  # empty without learned graders
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>coderl run {html.escape(run.name)}</title>
<style>body{{font-family:sans-serif;margin:2em}}figure{{display:inline-block;margin:0.5em}}
td{{padding:0.2em 0.8em;border-bottom:1px solid #ddd}}</style></head><body>
<h1>coderl run: {html.escape(str(run))}</h1>
<p>{len(metrics)} training steps logged; last step {last.get("step", "-")}.</p>
{audit_link}
<h2>Held-out evaluation (95% bootstrap CIs over tasks)</h2>
<table>{_summary_rows(evals) or "<tr><td>no evaluation logged</td></tr>"}</table>
<h2>Training curves</h2>
{figs}
{graders}
</body></html>
"""
    index = out / "index.html"
    index.write_text(page)
    return index


def run(args: argparse.Namespace) -> int:
    print(write_report(args.run_dir))
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("report", help="PNG plots and an HTML page for a training run")
    p.add_argument("run_dir")
    p.set_defaults(func=run)
