"""`coderl sft`: the supervised warm start on oracle episodes (:mod:`coderl.train.sft`)."""

from __future__ import annotations

import argparse

from coderl.config import load_config
from coderl.train.sft import run_sft


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    print(run_sft(cfg))
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("sft", help="supervised warm start on oracle episodes (training split)")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="key=value overrides")
    p.set_defaults(func=run)
