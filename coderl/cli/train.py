"""``coderl train CONFIG [key=value ...]`` and ``coderl train --resume RUN_DIR [key=value ...]``.

``--resume`` continues the run with its own ``config.yaml`` (:mod:`coderl.train.resume`);
a CONFIG given with it and the overrides are applied on top, printed, and refused where they
change what the checkpoint holds. Ctrl-C or SIGTERM (preemption, ``timeout``) ends in one line:
the last intact checkpoint and the resume command (exit 130; 143 for SIGTERM); the last completed
step is checkpointed first (:mod:`coderl.train.interrupt`). Stopped before any step completed:
the command that starts over.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

NO_CONFIG = "give a CONFIG (e.g. configs/default.yaml) or --resume RUN_DIR"
"""The refusal of ``coderl train`` and ``coderl train-async`` given neither: no run on the
built-in defaults that nobody asked for."""


def run(args: argparse.Namespace) -> int:
    from coderl.cli.sft import reuse_sft
    from coderl.config import load_config, split_preset
    from coderl.rundir import ensure_new_run, launch_rank, run_lock
    from coderl.train.ray_launch import launch, train_argv, wants_ray_launch

    config, overrides = split_preset(args.config, args.overrides)
    changes: dict[str, Any] = {}
    step = 0
    if args.resume:
        from coderl.train.resume import resume_config

        cfg, changes, step = resume_config(args.resume, config, overrides)
    elif config is None:
        raise ValueError(NO_CONFIG)
    else:
        cfg = load_config(config, overrides)
    if wants_ray_launch(cfg):  # this process starts the ranks; each runs this function
        from coderl.cli import main

        return launch(cfg, train_argv(args), main)
    needs_torchrun(args, cfg)
    # the refusals first (a live writer, another run's files, a file as run_dir), in a second:
    # before torch, the tasks and the model load, and before any SFT line is printed
    with run_lock(cfg.run_dir, "coderl train"):  # one writer, SFT and RL alike
        sft = False  # the SFT warm start runs here
        if not args.resume and launch_rank() == 0:
            ensure_new_run(cfg.run_dir)
            sft = cfg.sft.enabled and not reuse_sft(Path(cfg.run_dir), cfg)
            if cfg.sft.enabled and not sft:
                print(
                    f"warm start: RL starts from the SFT weights in {Path(cfg.run_dir) / 'sft'} "
                    "(same model, tasks and sft settings); SFT does not run"
                )
        return _train(args, cfg, changes, step, sft)


def _train(
    args: argparse.Namespace, cfg: Any, changes: dict[str, Any], step: int, sft: bool
) -> int:
    """``coderl train`` once its run directory is held and checked: the SFT warm start (``sft``;
    a sharded run's rank 0), RL, the held-out summary and the report."""
    from coderl.eval.observers import default_observers
    from coderl.policy.threads import use_threads
    from coderl.rundir import launch_rank
    from coderl.train.loop import train
    from coderl.train.resume import record_resume, stopped_line

    use_threads(cfg.threads)
    try:
        # a sharded run: rank 0 runs SFT alone while the other ranks wait to join the
        # process group (trainer.distributed.timeout_min), then every rank loads its shard
        if sft:
            from coderl.train.warmstart import warm_start

            warm_start(cfg)  # sft.cache: an earlier build of the same inputs is reused
        if args.resume:
            for line in record_resume(cfg, changes, step):
                print(line)
        run_dir = train(cfg, resume=bool(args.resume), observers=default_observers())
    except KeyboardInterrupt:
        if launch_rank() == 0:  # torchrun: one rank speaks for the run
            line = stopped_line("coderl train", cfg.run_dir, resume_command(cfg), over(args, cfg))
            print(line, file=sys.stderr)
        return 130
    if launch_rank() == 0:  # torchrun: one rank speaks, and writes the report
        end_of_run(run_dir, args.report)
    return 0


def end_of_run(run_dir: str | Path, report: bool) -> None:
    """What ``coderl train`` and ``coderl train-async`` end with: the held-out table
    ``coderl demo`` prints (none without evaluations) and, with ``report``, the report
    (``RUN_DIR/report``)."""
    from coderl.eval.summary import print_summary

    print_summary(run_dir)
    if report:
        from coderl.eval.report import write_report

        print(f"report: {write_report(run_dir)}")


def needs_torchrun(args: argparse.Namespace, cfg: Any) -> None:
    """Refuse a sharded run that torchrun did not start, before the model loads: one line with
    the command that launches it (``--nproc-per-node``: the resumed checkpoint's world size,
    else N).

    Raises:
        ValueError: ``trainer.distributed.enabled`` with the torchrun launcher and no
            ``WORLD_SIZE`` in the environment.
    """
    from coderl.rundir import list_checkpoints
    from coderl.train.ray_launch import train_argv

    dist = cfg.trainer.distributed
    if not dist.enabled or dist.launcher == "ray" or "WORLD_SIZE" in os.environ:
        return
    ranks = "N"
    if args.resume:
        named = Path(args.resume)
        ckpts = [named] if (named / "state.json").is_file() else list_checkpoints(named)
        if ckpts:
            state = json.loads((ckpts[-1] / "state.json").read_text())
            ranks = str(state.get("world_size", ranks))
    command = ["torchrun", "--nproc-per-node", ranks, "-m", "coderl", "train", *train_argv(args)]
    raise ValueError(
        f"trainer.distributed.enabled=true: torchrun starts the ranks; run: {shlex.join(command)}"
    )


def resume_command(cfg: Any) -> str:
    """The command that resumes ``cfg``'s run: ``coderl train --resume RUN_DIR``, as
    :func:`launched` runs it."""
    return launched(cfg, ["coderl", "train", "--resume", str(cfg.run_dir)])


def launched(cfg: Any, words: list[str]) -> str:
    """``words`` (``coderl ...``) as the user runs it again: under ``torchrun`` for a run
    torchrun started (its ranks per node from ``LOCAL_WORLD_SIZE``; on several nodes
    ``--nnodes`` too, and the user adds the rendezvous options they launched with)."""
    dist = cfg.trainer.distributed
    if not dist.enabled or dist.launcher == "ray" or "WORLD_SIZE" not in os.environ:
        return shlex.join(words)  # the Ray launcher's driver starts the ranks itself
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ["WORLD_SIZE"])
    nodes = int(os.environ["WORLD_SIZE"]) // per_node
    launch = ["torchrun", *(["--nnodes", str(nodes)] if nodes > 1 else [])]
    return shlex.join([*launch, "--nproc-per-node", str(per_node), "-m", *words])


def over(args: argparse.Namespace, cfg: Any, command: str = "train") -> str | None:
    """The command that starts an interrupted run with no checkpoint over: the same one
    (``coderl COMMAND ...``, :func:`launched`), after removing the logs it wrote before its
    first step completed (an evaluation before training: :func:`coderl.rundir.start_over`; a
    new run is refused over them); None for ``--resume``."""
    from coderl.rundir import existing_logs, start_over

    if args.resume:
        return None
    words = ["coderl", command, *([args.config] if args.config else []), *args.overrides]
    again = launched(cfg, words)
    logs = existing_logs(cfg.run_dir)
    return f"{start_over(logs)} && {again}" if logs else again


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
