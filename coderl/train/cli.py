"""``coderl train CONFIG [key=value ...] [--resume RUN_DIR]``."""

from __future__ import annotations

import argparse

from coderl.config import load_config


def run(args: argparse.Namespace) -> int:
    overrides = list(args.overrides)
    if args.resume:
        overrides.append(f"run_dir={args.resume}")
    cfg = load_config(args.config, overrides)
    if args.resume:
        from coderl.train.checkpoint import latest_checkpoint

        latest_checkpoint(cfg.run_dir)  # fail before loading a model when there is nothing
    if cfg.sft.enabled and not args.resume:
        from coderl.train.checkpoint import ensure_new_run
        from coderl.train.sft import run_sft

        ensure_new_run(cfg.run_dir)  # before minutes of SFT, not after

        run_sft(cfg)
    from coderl.eval.observers import default_observers
    from coderl.train.loop import train

    run_dir = train(cfg, resume=bool(args.resume), observers=default_observers())
    if args.report:
        from coderl.eval.report import write_report

        print(f"report: {write_report(run_dir)}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("train", help="RL training: rollouts, grading, rewards, updates")
    p.add_argument("config", help="YAML preset, e.g. configs/default.yaml")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. trainer.lr=2e-5")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue RUN_DIR from its checkpoint")
    p.add_argument("--no-report", dest="report", action="store_false", help="skip the report")
    p.set_defaults(func=run)
