"""Rendering and summing of ``coderl online cycle`` reports (:func:`coderl.online.cycle.run_cycle`):
the rich tables of :func:`print_report` and the per-phase totals over a cycle's tracks."""

from __future__ import annotations

import json
import math
from typing import Any

from rich.console import Console
from rich.table import Table

from coderl.online.cycle import PHASES


def _exploration_line(x: dict[str, Any]) -> str:
    t = x.get("traffic_share")
    said = "no traffic" if t is None else f"traffic {t:.3f}"  # nothing to count over: absent
    line = f"share {x['share']:g} at T={x['temperature']:g}; {said}"
    if "batch_share" in x:
        line += (
            f"; batch {x['batch_share']:.3f}, Kish ESS of the sequence weights "
            f"{x['ess_seqs']:.2f} ({x['ess_seqs_frac']:.3f} of the batch)"
        )
    return line


def _print_populations(pops: dict[str, Any], console: Console) -> None:
    t = Table(title="populations (own adapters)")
    for col in ("population", "decision", "trainable", "served -> after", "held-out lower bounds"):
        t.add_column(col)
    for name, r in pops.items():
        bounds = ", ".join(
            f"{c['metric']} {c['lower_bound']:.3f}"
            for c in r.get("gate", {}).get("comparisons", [])
        )
        moved = f"v{r['champion_before']} -> v{r['champion_after']}" if "candidate" in r else ""
        t.add_row(name, r["decision"], str(r["trainable"]), moved, bounds)
    console.print(t)


def measured(value: float | None, spec: str = ".3g") -> str:
    """``value`` formatted with ``spec``; ``n/a`` where nothing was measured (absent, or NaN: a
    rate over no events), never ``nan`` or a placeholder 0 printed as a number."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return format(value, spec)


def _fmt_ci(e: dict[str, float]) -> str:
    return f"{e['mean']:.3f} [{e['lo']:.3f}, {e['hi']:.3f}]"


def _tracks(rep: dict[str, Any]) -> list[dict[str, Any]]:
    """The shared track's report (the top level) and each population track's."""
    return [rep, *(t for t in (rep.get("populations") or {}).values() if isinstance(t, dict))]


def phase_totals(rep: dict[str, Any]) -> dict[str, float]:
    """Seconds per phase of a whole cycle: the shared track's ``{phase}_s`` plus every
    population track's (``rep["populations"]``); only the phases some track timed."""
    tracks = _tracks(rep)
    return {
        p: sum(float(t.get(f"{p}_s", 0.0)) for t in tracks)
        for p in PHASES
        if any(f"{p}_s" in t for t in tracks)
    }


def trained(rep: dict[str, Any]) -> bool:
    """Whether some track of the cycle trained a candidate (not every track waited)."""
    return any("train_s" in t for t in _tracks(rep))


def phase_split(rep: dict[str, Any]) -> str:
    """``collect 12.3 / finalize 0.1 / ...``: the phases a cycle timed, in seconds, summed over
    its tracks (:func:`phase_totals`)."""
    return " / ".join(f"{p} {v:.1f}" for p, v in phase_totals(rep).items())


def print_report(rep: dict[str, Any], console: Console | None = None) -> None:
    """A cycle report as rich tables: decision, timings, exclusions, gate, monitors."""
    console = console or Console()
    t = Table(title=f"online cycle: {rep['decision']}", show_header=False)
    labels = {  # cycle_s starts after the collection that `online run` times on its own
        "cycle_s": "cycle_s (finalize to promote)",
        "total_s": "total_s (collect included)",
    }
    for k in ("champion_before", "candidate", "champion_after", "trainable", "cycle_s", "total_s"):
        if k in rep:
            v = rep[k]
            t.add_row(labels.get(k, k), f"{v:.2f}" if isinstance(v, float) else str(v))
    t.add_row("phases (s)", phase_split(rep))
    t.add_row("excluded", json.dumps(rep.get("excluded", {})))
    t.add_row("finalize", json.dumps({k: v for k, v in rep["finalize"].items() if v}))
    t.add_row(
        "rejected / duplicate events",
        f"{json.dumps(rep['rejected_events'])} / {rep['duplicate_events']}",
    )
    for k in (
        "train_reward_mean",
        "kl",
        "ess_tokens_frac",
        "ess_seqs_frac",
        "clip_frac_high",
        "iw_max",
    ):
        if k in rep.get("train", {}):
            t.add_row(f"train {k}", measured(rep["train"][k], ".4f"))
    for c in rep.get("gate", {}).get("comparisons", []):
        t.add_row(
            f"held-out {c['metric']}",
            f"cand {c['candidate_mean']:.3f} vs champ "
            f"{c['champion_mean']:.3f} (lower {c['lower_bound']:.3f}, margin {c['margin']})",
        )
    for metric, pols in rep.get("heldout", {}).items():
        t.add_row(
            f"held-out {metric} (95% CI)",
            ", ".join(f"{p} {_fmt_ci(e)}" for p, e in pols.items())
            + f" over {pols['champion']['n']} tasks",
        )
    for pop, e in rep.get("population_rewards", {}).items():
        t.add_row(
            f"reward {pop} (95% CI)", f"{_fmt_ci(e)} over {e['n']} episodes, {e['turns']} turns"
        )
    for r in rep.get("gate", {}).get("reasons", []):
        t.add_row("reason", r)
    if x := rep.get("exploration"):
        t.add_row("exploration", _exploration_line(x))
    console.print(t)
    if pops := rep.get("populations"):
        _print_populations(pops, console)
    mon = rep.get("monitors", {}).get("by_version", {})
    if mon:
        cols = [(v, p, m) for v, pops in mon.items() for p, m in pops.items()]
        mt = Table(title="monitors per version/population (trailing window)")
        mt.add_column("metric")
        for v, p, _ in cols:
            mt.add_column(f"v{v}/{p}")
        names = sorted({k for _, _, m in cols for k in m}, key=lambda k: (k.startswith("r"), k))
        for k in names:
            mt.add_row(k, *[measured(m.get(k)) for _, _, m in cols])
        console.print(mt)
        share = measured(rep["monitors"]["orphaned_share"], ".3f")  # n/a: no event yet
        console.print(f"orphaned share of events: {share}")
