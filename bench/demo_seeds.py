"""The demo's claim over several training seeds: each run's RL-only held-out pass@1 change
(after RL - after SFT, paired by task, 95% paired-bootstrap CI) and the change pooled over the
runs (:func:`coderl.eval.passk.pooled_change`: each task's change averaged over the runs, tasks
resampled), for the held-out split and for every split of ``eval.extra_splits`` the runs
evaluated (``eval_extra.jsonl``, e.g. the kept-back ``outside`` set).

Run the demo once per seed, then read the run directories::

    .venv/bin/python bench/demo_profile.py --run-dir runs/seed0 seed=0 'eval.extra_splits=[outside]'
    .venv/bin/python bench/demo_profile.py --run-dir runs/seed1 seed=1
    .venv/bin/python bench/demo_profile.py --run-dir runs/seed2 seed=2
    .venv/bin/python bench/demo_seeds.py runs/seed0 runs/seed1 runs/seed2

Nothing is run here: it reads ``eval.jsonl``, ``eval_extra.jsonl`` and ``config.yaml``. A run
whose RL phase did not finish (no evaluation after RL) is named and left out of the pool.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import yaml

from coderl.eval.passk import compare, pooled_change
from coderl.eval.summary import ci_text, read_extra_evals, rl_start


def read_evals(run_dir: Path) -> dict[str, list[dict[str, Any]]]:
    """The run's evaluation records by split: ``heldout`` from ``eval.jsonl``, the rest from
    ``eval_extra.jsonl``."""
    path = run_dir / "eval.jsonl"
    if not path.is_file():
        raise SystemExit(f"{run_dir}: no eval.jsonl (did the demo run there?)")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {"heldout": rows, **read_extra_evals(run_dir)}


def start_and_end(evals: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The evaluation RL starts from and the last one after it; None when RL did not finish."""
    start = rl_start(evals)
    if start is None or evals[-1] is start or evals[-1].get("step", 0) <= start.get("step", 0):
        return None
    return start, evals[-1]


def split_table(name: str, runs: list[tuple[str, int, list[dict[str, Any]]]]) -> dict[str, Any]:
    """Print one split's rows (one per run, then the pool) and return them as a dict."""
    print(f"\n{name}: pass@1 after SFT -> after RL, RL-only change (paired, 95% CI)")
    print(
        f"  {'run':<24} {'seed':>4} {'tasks x n':>10}  {'after SFT':<22} {'after RL':<22} RL only"
    )
    rows, pairs = [], []
    for label, seed, evals in runs:
        ends = start_and_end(evals)
        if ends is None:
            print(f"  {label:<24} {seed:>4}  RL did not finish: left out")
            continue
        start, end = ends
        c = compare(start, end)
        b, a = start["pass_at"]["1"], end["pass_at"]["1"]
        n = min(t["n"] for t in start["per_task"])
        shape = f"{len(start['per_task'])} x {n}"
        print(
            f"  {label:<24} {seed:>4} {shape:>10}  {ci_text(b):<22} "
            f"{ci_text(a):<22} "
            f"{ci_text(c.pass1, True)}"
            f"{'  excludes 0' if c.excludes_zero else ''}"
        )
        rows.append({"run": label, "seed": seed, "before": b, "after": a, "change": vars(c.pass1)})
        pairs.append((start["per_task"], end["per_task"]))
    out: dict[str, Any] = {"runs": rows}
    if pairs:
        p = pooled_change(pairs)
        signs = {(r["change"]["mean"] > 0) - (r["change"]["mean"] < 0) for r in rows}
        print(
            f"  {'pooled (' + str(len(pairs)) + ' runs)':<24} {'':>4} {'':>10}  {'':<22} {'':<22} "
            f"{ci_text(p, True)}{'  excludes 0' if p.lo > 0 or p.hi < 0 else ''}"
        )
        print(f"  signs of the runs' changes: {'the same' if len(signs) == 1 else 'mixed'}")
        out["pooled"] = vars(p)
        out["same_sign"] = len(signs) == 1
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dirs", nargs="+", type=Path)
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args()
    by_split: dict[str, list[tuple[str, int, list[dict[str, Any]]]]] = {}
    for d in args.run_dirs:
        cfg = (
            yaml.safe_load((d / "config.yaml").read_text()) if (d / "config.yaml").is_file() else {}
        )
        for split, evals in read_evals(d).items():
            by_split.setdefault(split, []).append((str(d), int(cfg.get("seed", -1)), evals))
    result = {split: split_table(split, runs) for split, runs in by_split.items()}
    print(
        "\npooled: each task's change averaged over the runs, tasks resampled; conditional on "
        "these training seeds (the seeds are not resampled)"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
