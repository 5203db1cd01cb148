"""What a run's held-out evaluations say, in a few lines: the one summary that ``coderl demo``
prints and the run report (:mod:`coderl.eval.report`) shows.

Reads the records of ``eval.jsonl`` (``EvalResult.to_dict()`` plus ``step``, ``phase``,
``temperature``, ``time_s``) and the run's ``phases.json`` (wall seconds of the phases
``coderl demo`` timed) and states: pass@1 with its 95% CI at each evaluation phase (base model,
after SFT, after RL), the paired RL-only change (after RL - after SFT) and the whole-run change
(after RL - first evaluation) with their 95% paired-bootstrap CIs, the same RL-only change and
pass@k before/after RL per task family when the split mixes several (each task's ``source``:
the repair demo's held-out library and HumanEval's held-out problems), pass@k at the largest k
before and after RL (the collapse check), the collapse alarm of the periodic evaluations
(:func:`collapse_line`), the broken-call rate before and after RL (when tool calls were parsed:
:func:`parsed_calls`), the last evaluation's
self-summaries and prefill per episode (:func:`context_rows`, multi-turn episodes only), the
same pass@1 rows and paired RL-only change for each further split of ``eval.extra_splits``
(``eval_extra.jsonl``, :func:`read_extra_evals`; labels start with the split's name), and the
phase times.
The comparisons are :func:`coderl.eval.passk.compare`; nothing is computed here that is not
computed there.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from coderl.eval.passk import Comparison, Estimate, compare, summarize
from coderl.metrics import reported

PHASES_FILE = "phases.json"
"""``RUN_DIR/phases.json``: ``{"sft_s": ..., "train_s": ...}`` wall seconds, with
``<phase>_cpu_s`` and ``<phase>_children_cpu_s`` beside them (CPU seconds of the process and
of its reaped children), and ``sft_reused`` (1.0: the SFT weights were copied from the
warm-start cache, :mod:`coderl.train.warmstart`, and SFT did not run: ``sft_s`` is the copy's
time), written by ``coderl demo`` (absent for runs it did not time)."""


def phase_name(e: dict[str, Any], last: bool) -> str:
    """A human name for one evaluation record: base model, after SFT, start, after RL."""
    phase = e.get("phase")
    if phase == "base":
        return "base model"
    if phase == "sft":
        return "after SFT"
    if phase == "start":
        return "start"
    return f"after RL (step {e['step']})" if last else f"step {e['step']}"


def rl_start(evals: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The evaluation RL starts from (``phase`` ``sft`` or ``start``), None if absent."""
    return next((e for e in evals if e.get("phase") in ("sft", "start")), None)


def ci_text(e: Estimate | dict[str, float], signed: bool = False) -> str:
    """``mean [lo, hi]`` to three decimals (``signed``: with a sign, for changes)."""
    m, lo, hi = (e.mean, e.lo, e.hi) if isinstance(e, Estimate) else (e["mean"], e["lo"], e["hi"])
    f = "{:+.3f}" if signed else "{:.3f}"
    return f"{f.format(m)} [{f.format(lo)}, {f.format(hi)}]"


def _change(c: Comparison) -> str:
    verdict = "excludes zero" if c.excludes_zero else "includes zero"
    return f"{ci_text(c.pass1, signed=True)} ({verdict})"


def summary_lines(
    evals: list[dict[str, Any]],
    metrics: list[dict[str, Any]] | None = None,
    phases: dict[str, float] | None = None,
    extra: dict[str, list[dict[str, Any]]] | None = None,
) -> list[tuple[str, str]]:
    """``(label, statement)`` rows summarising a run's evaluations (see the module docstring);
    ``metrics`` (the rows of ``metrics.jsonl``) give the RL steps' time; ``phases`` the timed
    phases; ``extra`` the evaluations of further splits (:func:`read_extra_evals`), each
    reported apart with its own rows. Empty without held-out evaluations.

    Raises:
        ValueError: two evaluations compared do not hold the same tasks.
    """
    if not evals:
        return []
    rows = evaluation_rows(evals)
    rows.extend(context_rows(evals[-1]))
    alarm = collapse_line(evals)
    if alarm:
        rows.append(("collapse alarm (pass@k vs the best earlier evaluation)", alarm))
    for split, records in (extra or {}).items():
        rows.extend((f"{split} split: {label}", text) for label, text in evaluation_rows(records))
    rows.append(("phase times", _phase_times(evals, metrics or [], phases or {}, extra or {})))
    return rows


def evaluation_rows(evals: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """The rows of one split's evaluations: pass@1 per phase, the paired RL-only and whole-run
    changes, pass@k at the largest k before and after RL, broken calls, per-family changes.

    Raises:
        ValueError: two evaluations compared do not hold the same tasks.
    """
    rows: list[tuple[str, str]] = []
    first, last, start = evals[0], evals[-1], rl_start(evals)
    for i, e in enumerate(evals):
        n, temp = e["samples"], e.get("temperature")
        how = f"n={n}" + (f", T={temp}" if temp is not None else "")
        name = phase_name(e, i == len(evals) - 1)
        rows.append((f"pass@1, {name}", f"{ci_text(e['pass_at']['1'])} ({how})"))
    if not all(e.get("per_task") for e in evals):
        pass  # records without per-task counts (older runs) cannot be paired
    elif start is not None and start is not last:
        rl = compare(start, last)
        rows.append(("RL only: pass@1 change (paired, 95% CI)", _change(rl)))
        if first is not start:
            rows.append(
                ("whole run: pass@1 change (paired, 95% CI)", _change(compare(first, last)))
            )
        rows.append(
            (
                f"pass@{rl.k} before -> after RL (collapse check)",
                f"{ci_text(rl.passk_before)} -> {ci_text(rl.passk_after)}; "
                f"paired change {ci_text(rl.passk, signed=True)}",
            )
        )
        if parsed_calls(start) and parsed_calls(last):  # else no call was parsed: absent
            rows.append(("broken calls per episode before -> after RL", _broken(rl)))
        rows.extend(family_rows(start, last))
    elif len(evals) >= 2:
        rows.append(("whole run: pass@1 change (paired, 95% CI)", _change(compare(first, last))))
    return rows


def parsed_calls(e: dict[str, Any]) -> bool:
    """Whether an evaluation record's episodes had their replies parsed as tool calls (its
    broken-call counts measure something); a record from before ``tool_episodes`` was counted:
    whether it returned episodes."""
    return any(t.get("tool_episodes", t.get("episodes", 0)) for t in e["per_task"])


def _broken(rl: Any) -> str:
    (b0, b1), (r0, r1) = rl.broken_calls, rl.broken_episode_rate
    text = f"{b0:.2f} -> {b1:.2f} (episodes with one: {r0:.0%} -> {r1:.0%})"
    if rl.broken_change is not None:
        text += f"; paired change {ci_text(rl.broken_change, signed=True)}"
    return text


def context_rows(e: dict[str, Any]) -> list[tuple[str, str]]:
    """The self-summaries and the multi-turn prefill of one evaluation (its ``context``:
    :attr:`coderl.eval.passk.EvalResult.context`); empty for records without it and for
    evaluations whose episodes were all one model turn (nothing to summarise or reuse)."""
    c = e.get("context") or {}
    if not c or not c.get("multi_turn", 1):  # single replies: no summary, no KV to reuse
        return []
    return [
        (
            "self-summaries, last evaluation (episodes)",
            f"{c['summarised']:.0f} summarised, {c['continued']:.0f} went on after the summary, "
            f"{c['continued_resolved']:.0f} of those resolved",
        ),
        (
            "prefill per episode, last evaluation (tokens)",
            f"{c['prefill_tokens']:.0f} with KV reuse across turns, {c['prompt_tokens']:.0f} "
            f"without; {c['distinct_tokens']:.0f} distinct",
        ),
    ]


def collapse_line(evals: list[dict[str, Any]]) -> str:
    """What the collapse checks of a run's evaluations said (the ``collapse`` field that
    :func:`coderl.train.heldout.log_eval_with_alarm` writes): the steps where the alarm was raised,
    or that it never was, with the largest drop (or "no drop" when pass@k never fell: a rise is
    not printed as a negative drop); "" when no evaluation holds a check."""
    checks = [(e["step"], e["collapse"]) for e in evals if e.get("collapse")]
    if not checks:
        return ""
    step, worst = max(checks, key=lambda sc: sc[1]["drop"])
    rule = "upper end of the paired 95% CI of the change below 0"
    versus = (
        f"pass@{worst['k']} vs step {worst['best_step']}, change {ci_text(worst['change'], True)}"
    )
    if worst["drop"] > 0:
        where = f"largest drop {worst['drop']:.3f} at step {step} ({versus})"
    else:  # drop = best earlier - now: <= 0 at every check means nothing fell
        where = f"no drop: pass@{worst['k']} never fell below the best earlier evaluation "
        where += f"(smallest change at step {step}: {versus})"
    raised = [str(s) for s, c in checks if c["alarm"]]
    if raised:
        return f"RAISED at step {', '.join(raised)} of {len(checks)} checks ({rule}); {where}"
    return f"not raised in {len(checks)} checks ({rule}); {where}"


def families(e: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """One evaluation record split by task family (each ``per_task`` row's ``source``, in order
    of first appearance): ``{source: record}``, each record holding that family's rows with its
    pass@k recomputed (:func:`coderl.eval.passk.summarize`). Empty when the rows hold fewer than
    two families (or predate ``source``)."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in e["per_task"]:
        groups.setdefault(str(row.get("source")), []).append(row)
    if len(groups) < 2 or "None" in groups:
        return {}
    ks = [int(k) for k in e["pass_at"]]
    return {
        name: {**summarize(rows, ks, e["samples"]).to_dict(), "source": name}
        for name, rows in groups.items()
    }


def family_rows(start: dict[str, Any], last: dict[str, Any]) -> list[tuple[str, str]]:
    """Per task family (:func:`families`): pass@1 and pass@k at the largest k before -> after RL
    and the paired RL-only change of pass@1, each with its 95% CI (:func:`compare` on the
    family's tasks alone). Empty for a single family."""
    before, after = families(start), families(last)
    rows: list[tuple[str, str]] = []
    for name, b in before.items():
        c = compare(b, after[name])
        n = len(b["per_task"])
        rows.append(
            (
                f"{name} ({n} tasks): pass@1 / pass@{c.k} before -> after RL",
                f"{ci_text(b['pass_at']['1'])} -> {ci_text(after[name]['pass_at']['1'])}; "
                f"pass@{c.k} {ci_text(c.passk_before)} -> {ci_text(c.passk_after)}",
            )
        )
        rows.append((f"{name}: RL only pass@1 change (paired, 95% CI)", _change(c)))
    return rows


def _phase_times(
    evals: list[dict[str, Any]],
    metrics: list[dict[str, Any]],
    phases: dict[str, float],
    extra: dict[str, list[dict[str, Any]]] | None = None,
) -> str:
    parts = []
    if phases.get("sft_reused"):
        parts.append(f"SFT not run: reused from the warm-start cache ({phases['sft_s']:.0f} s)")
    elif "sft_s" in phases:
        parts.append(f"SFT {phases['sft_s']:.0f} s")
    by_split = {"": evals, **{f"{split} ": records for split, records in (extra or {}).items()}}
    for prefix, records in by_split.items():  # prefix "": the held-out split
        for i, e in enumerate(records):
            if "time_s" in e:
                name = phase_name(e, i == len(records) - 1)
                parts.append(f"eval {prefix}{name} {e['time_s']:.0f} s")
    keys = ("time/rollout", "time/grading", "time/train", "time/sync")
    rl = sum(r.get(k, 0.0) for r in metrics for k in keys)
    timed = any(k in r for r in metrics for k in keys)  # train-async logs no per-phase times
    if metrics:
        parts.append(f"RL {len(metrics)} steps" + (f" {rl:.0f} s" if timed else " (not timed)"))
    if "train_s" in phases and (timed or not metrics):  # else "other" would hold the RL time
        evals_s = sum(e.get("time_s", 0.0) for records in by_split.values() for e in records)
        other = phases["train_s"] - evals_s - rl
        parts.append(f"other (model load, checkpoints) {other:.0f} s")
    total = phases.get("sft_s", 0.0) + phases.get("train_s", 0.0)
    if total:
        parts.append(f"total {total / 60:.1f} min")
    return "; ".join(parts) or "not timed"


def read_extra_evals(run_dir: str | Path) -> dict[str, list[dict[str, Any]]]:
    """The records of ``RUN_DIR/eval_extra.jsonl`` (``eval.extra_splits``) by split, splits in
    order of first appearance ({} when there are none)."""
    from coderl.metrics import EXTRA_EVAL_FILE, read_jsonl

    out: dict[str, list[dict[str, Any]]] = {}
    for record in read_jsonl(Path(run_dir) / EXTRA_EVAL_FILE):
        out.setdefault(str(record["split"]), []).append(record)
    return out


def read_phases(run_dir: str | Path) -> dict[str, float]:
    """``RUN_DIR/phases.json`` ({} when absent)."""
    p = Path(run_dir) / PHASES_FILE
    return json.loads(p.read_text()) if p.is_file() else {}


def write_phases(run_dir: str | Path, phases: dict[str, float]) -> Path:
    """Write ``RUN_DIR/phases.json``; returns its path."""
    p = Path(run_dir) / PHASES_FILE
    p.write_text(json.dumps(reported(phases), indent=1) + "\n")
    return p


def print_summary(run_dir: str | Path, phases: dict[str, float] | None = None) -> bool:
    """Print the held-out summary table of a run (:func:`summary_lines` of its ``eval.jsonl``
    and ``metrics.jsonl``) on stdout, as ``coderl demo`` and the end of ``coderl train`` show
    it; returns whether there was anything to print (a run without evaluations prints
    nothing)."""
    from rich.console import Console
    from rich.table import Table

    from coderl.config import load_config
    from coderl.metrics import read_jsonl

    run_dir = Path(run_dir)
    evals, extra = read_jsonl(run_dir / "eval.jsonl"), read_extra_evals(run_dir)
    rows = summary_lines(evals, read_jsonl(run_dir / "metrics.jsonl"), phases, extra)
    if not rows:
        return False
    split = load_config(run_dir / "config.yaml").tasks.heldout_split
    also = "".join(f"; {s} split apart" for s in extra)
    table = Table(title=f"held-out summary ({split} split{also}, 95% CIs)", show_header=False)
    table.add_column("what")
    table.add_column("measured")
    for label, text in rows:
        table.add_row(label, text)
    Console().print(table)
    return True
