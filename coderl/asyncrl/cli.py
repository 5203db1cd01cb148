"""``coderl train-async CONFIG [key=value ...]``: asynchronous training with bounded staleness.

The config is the ``coderl train`` tree, whose ``async:`` section
(:class:`coderl.config.AsyncConfig`) this command reads; ``async.max_staleness=1`` and the like
override it.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from rich.console import Console


def run(args: argparse.Namespace) -> int:
    from coderl.asyncrl.trainer import train_async  # heavy imports, on use only
    from coderl.config import load_config

    cfg = load_config(args.config, args.overrides)
    try:
        summary = train_async(cfg, resume=args.resume)
    except KeyboardInterrupt:
        from coderl.train.resume import stopped_line

        words = [*([args.config] if args.config else []), *args.overrides]
        again = shlex.join(["coderl", "train-async", *words, "--resume"])
        print(stopped_line("coderl train-async", cfg.run_dir, again), file=sys.stderr)
        return 130
    console = Console()
    console.print(f"[bold]async run finished[/] in {cfg.run_dir}")
    for key, value in summary.items():
        console.print(f"  {key}: {value:.4g}" if isinstance(value, float) else f"  {key}: {value}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "train-async",
        help="train with rollout workers decoupled from the trainer (bounded staleness)",
    )
    p.add_argument(
        "config", nargs="?", default=None, help="YAML preset (default: built-in defaults)"
    )
    p.add_argument(
        "overrides", nargs="*", help="key=value overrides, async.* for the async section"
    )
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    p.set_defaults(func=run)
