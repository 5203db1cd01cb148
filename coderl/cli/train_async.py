"""``coderl train-async CONFIG [key=value ...]``: asynchronous training with bounded staleness.

The config is the ``coderl train`` tree, whose ``async:`` section
(:class:`coderl.config.AsyncConfig`) this command reads; ``async.max_staleness=1`` and the like
override it. ``--resume RUN_DIR`` (or ``--resume`` after the command line that started the run)
continues the run with its own ``config.yaml``, as ``coderl train --resume`` does
(:mod:`coderl.train.resume`): a CONFIG and overrides given with it are applied on top, printed,
and refused where they change what the checkpoint holds. Ctrl-C or SIGTERM checkpoints the last
completed step and prints the resume command, as ``coderl train`` does. Without a CONFIG or ``--resume
RUN_DIR`` it refuses in one line, as ``coderl train`` does (no run on the built-in defaults a
user did not ask for). It ends as ``coderl train`` ends: the held-out summary, the report
(``RUN_DIR/report``; ``--no-report`` skips it) and, where no step updated the policy, the
warning that says so (:class:`coderl.train.run.UpdateCount`).
"""

from __future__ import annotations

import argparse
import shlex
import sys

from rich.console import Console


def run(args: argparse.Namespace) -> int:
    from coderl.cli.train import NO_CONFIG, over
    from coderl.config import load_config, split_preset
    from coderl.rundir import ensure_new_run, run_lock

    config, overrides = split_preset(args.config, args.overrides)
    named = args.resume if isinstance(args.resume, str) else None
    if config is None and named is None:
        raise ValueError(NO_CONFIG)
    if args.resume:
        from coderl.train.resume import resume_config

        run_dir = named or load_config(config, overrides).run_dir
        cfg, changes, step = resume_config(run_dir, config, overrides, "coderl train-async")
    else:
        cfg = load_config(config, overrides)
    # the refusals first, in a second: before torch, the tasks and the model load
    with run_lock(cfg.run_dir, "coderl train-async"):  # one writer at a time
        if not args.resume:
            ensure_new_run(cfg.run_dir)
        from coderl.asyncrl.trainer import train_async  # heavy imports, after the refusals
        from coderl.policy.threads import use_threads
        from coderl.train.resume import record_resume, stopped_line

        use_threads(cfg.threads)  # the workers set their own (EnvSampler)
        if args.resume:
            for line in record_resume(cfg, changes, step):
                print(line)
        try:
            summary = train_async(cfg, resume=bool(args.resume))
        except KeyboardInterrupt:
            resume = f"coderl train-async --resume {shlex.quote(str(cfg.run_dir))}"
            again = over(
                args, cfg, "train-async"
            )  # no checkpoint yet: the command that starts over
            line = stopped_line("coderl train-async", cfg.run_dir, resume, again)
            print(line, file=sys.stderr)
            return 130
    console = Console()
    console.print(f"[bold]async run finished[/] in {cfg.run_dir}")
    for key, value in summary.items():
        console.print(f"  {key}: {value:.4g}" if isinstance(value, float) else f"  {key}: {value}")
    from coderl.cli.train import end_of_run

    end_of_run(cfg.run_dir, args.report)  # the held-out table and the report, as coderl train
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "train-async",
        help="train with rollout workers decoupled from the trainer (bounded staleness)",
    )
    p.add_argument(
        "config",
        nargs="?",
        default=None,
        help="YAML preset, e.g. configs/toy.yaml (with --resume: applied on top of the run's "
        "own config.yaml; usually left out)",
    )
    p.add_argument(
        "overrides", nargs="*", help="key=value overrides, async.* for the async section"
    )
    p.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=None,
        metavar="RUN_DIR",
        help="continue RUN_DIR (or the run the command line names) from its latest checkpoint "
        "with its own config.yaml",
    )
    p.add_argument("--no-report", dest="report", action="store_false", help="skip the report")
    p.set_defaults(func=run)
