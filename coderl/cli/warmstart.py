"""``coderl warm-start [--config CONFIG] [key=value ...]``: build the SFT warm start's cache
entry of a config (default ``configs/repair.yaml``, the demo's) when it is missing or damaged,
outside any run (:mod:`coderl.train.warmstart`); ``make warm-start`` runs it. A later run of the
same inputs with ``sft.cache`` (``coderl demo``, ``coderl train``, ``coderl sft``) copies the
entry instead of running SFT. ``--force`` deletes the entry and builds it again."""

from __future__ import annotations

import argparse
from pathlib import Path

from coderl.cli.demo import DEFAULT_CONFIG


def run(args: argparse.Namespace) -> int:
    from coderl.config import load_config
    from coderl.policy.threads import use_threads
    from coderl.train.warmstart import build_entry, cache_root

    cfg = load_config(Path(args.config), args.overrides)
    use_threads(cfg.threads)
    if not cfg.sft.enabled:
        raise ValueError(f"{args.config}: sft.enabled is false: there is no warm start to build")
    ws = build_entry(cfg, force=args.force)
    state = "was cached already" if ws.reused else "built"
    print(f"warm start {ws.key}: {state}, {cache_root() / str(ws.key)}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("warm-start", help="build the SFT warm start's cache entry of a config")
    p.add_argument("overrides", nargs="*", help="key=value overrides of the config")
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="preset (default: repair.yaml)")
    p.add_argument("--force", action="store_true", help="delete the entry and build it again")
    p.set_defaults(func=run)
