"""`coderl report`: PNG plots and an HTML page for a training run (:mod:`coderl.eval.report`)."""

from __future__ import annotations

import argparse

from coderl.eval.report import write_report


def run(args: argparse.Namespace) -> int:
    print(write_report(args.run_dir))
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("report", help="PNG plots and an HTML page for a training run")
    p.add_argument("run_dir", help="a run directory (its metrics.jsonl and eval.jsonl)")
    p.set_defaults(func=run)
