"""``coderl train CONFIG [key=value ...]`` and ``coderl train --resume RUN_DIR [key=value ...]``.

``--resume`` continues the run with its own ``config.yaml`` (:mod:`coderl.train.resume`);
a CONFIG given with it and the overrides are applied on top, printed, and refused where they
change what the checkpoint holds. Ctrl-C or SIGTERM (preemption, ``timeout``) ends in one line:
the last intact checkpoint and the resume command (exit 130; 143 for SIGTERM).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Any


def run(args: argparse.Namespace) -> int:
    from coderl.config import load_config
    from coderl.train.resume import record_resume, resume_config, split_preset, stopped_line

    config, overrides = split_preset(args.config, args.overrides)
    if args.resume:
        cfg, changes, step = resume_config(args.resume, config, overrides)
    elif config is None:
        raise ValueError("give a CONFIG (e.g. configs/default.yaml) or --resume RUN_DIR")
    else:
        cfg = load_config(config, overrides)
    from coderl.train.ray_launch import launch, train_argv, wants_ray_launch

    if wants_ray_launch(cfg):  # this process starts the ranks; each runs this function
        from coderl.cli import main

        return launch(cfg, train_argv(args), main)
    from coderl.eval.observers import default_observers
    from coderl.rundir import launch_rank, run_lock
    from coderl.train.loop import train

    with run_lock(cfg.run_dir, "coderl train"):  # one writer, SFT and RL alike
        try:
            # a sharded run: rank 0 runs SFT alone while the other ranks wait to join the
            # process group (trainer.distributed.timeout_min), then every rank loads its shard
            if cfg.sft.enabled and not args.resume and launch_rank() == 0:
                from coderl.train.checkpoint import ensure_new_run
                from coderl.train.warmstart import warm_start

                ensure_new_run(cfg.run_dir)  # before minutes of SFT, not after
                warm_start(cfg)  # sft.cache: an earlier build of the same inputs is reused
            if args.resume:
                for line in record_resume(cfg, changes, step):
                    print(line)
            run_dir = train(cfg, resume=bool(args.resume), observers=default_observers())
        except KeyboardInterrupt:
            resume = f"coderl train --resume {shlex.quote(str(cfg.run_dir))}"
            print(
                stopped_line("coderl train", cfg.run_dir, resume, over(args, cfg)), file=sys.stderr
            )
            return 130
    from coderl.eval.summary import print_summary

    if launch_rank() == 0:  # torchrun: one rank speaks
        print_summary(run_dir)  # the held-out table coderl demo prints (none without evals)
    if args.report:
        from coderl.eval.report import write_report

        print(f"report: {write_report(run_dir)}")
    return 0


def over(args: argparse.Namespace, cfg: Any) -> str | None:
    """The command that starts an interrupted run over: the same one, while the run has logged
    no RL step (it stopped in its SFT warm start or setup); None after (a new run would be
    refused there, :func:`coderl.rundir.ensure_fresh_logs`)."""
    from coderl.rundir import existing_logs

    if args.resume or existing_logs(cfg.run_dir):
        return None
    return shlex.join(["coderl", "train", *([args.config] if args.config else []), *args.overrides])


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("train", help="RL training: rollouts, grading, rewards, updates")
    p.add_argument(
        "config",
        nargs="?",
        help="YAML preset, e.g. configs/default.yaml (with --resume: applied on top of the "
        "run's own config.yaml; usually left out)",
    )
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. trainer.lr=2e-5")
    p.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue RUN_DIR from its latest checkpoint with its own config.yaml (or from "
        "RUN_DIR/checkpoints/step-N: newer checkpoints are set aside to checkpoints/superseded/)",
    )
    p.add_argument("--no-report", dest="report", action="store_false", help="skip the report")
    p.set_defaults(func=run)
