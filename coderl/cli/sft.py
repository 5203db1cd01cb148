"""`coderl sft`: the supervised warm start on oracle episodes (:mod:`coderl.train.sft`).

One writer at a time (:func:`coderl.rundir.run_lock`); a directory holding another run
(checkpoints, training logs, a config of another model or task source) is refused
(:func:`ensure_sft_dir`); earlier SFT weights of the run are kept
unless ``--force``; the run's ``config.yaml`` is written when absent, so that ``coderl eval``,
``export`` and ``report`` take the run. Ctrl-C or SIGTERM ends in one line: nothing was written
and the command that starts it again (exit 130; 143 for SIGTERM)."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from coderl.config import Config, anchored, dump_config, load_config
from coderl.rundir import existing_logs, run_lock
from coderl.train.checkpoint import list_checkpoints
from coderl.train.run import SFT_WEIGHTS
from coderl.train.warmstart import warm_start


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    run_dir = Path(cfg.run_dir)
    with run_lock(run_dir, "coderl sft"):  # one writer at a time
        ensure_sft_dir(run_dir, cfg)
        if (run_dir / SFT_WEIGHTS).is_file() and not args.force:
            raise FileExistsError(
                f"{run_dir / SFT_WEIGHTS} exists (an earlier coderl sft); --force replaces it, "
                "or set run_dir=... to write elsewhere"
            )
        if not (run_dir / "config.yaml").is_file():  # what eval and export read the run with
            (run_dir / "config.yaml").write_text(dump_config(anchored(cfg)))
        try:
            print(warm_start(cfg).path)  # sft.cache: an earlier build of the same inputs
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: SFT keeps no partial weights
            again = shlex.join(["coderl", "sft", args.config, *args.overrides])
            print(
                f"coderl sft: interrupted; no SFT weights written to {run_dir / SFT_WEIGHTS}; "
                f"start again with: {again}",
                file=sys.stderr,
            )
            return 130
    return 0


def ensure_sft_dir(run_dir: Path, cfg: Config) -> None:
    """Refuse a ``run_dir`` that is neither new nor an earlier ``coderl sft`` of the same model
    and tasks: one holding a run's checkpoints or logs (:data:`coderl.rundir.RUN_LOGS`), or a
    ``config.yaml`` of another model or task source, is another run's.

    Raises:
        FileExistsError: one line naming what the directory holds and ``run_dir=...``.
    """
    held = [p.name for p in existing_logs(run_dir)]
    if ckpts := list_checkpoints(run_dir):
        held.insert(0, f"checkpoints up to {ckpts[-1].name}")
    saved = run_dir / "config.yaml"
    if not held and saved.is_file():
        theirs = anchored(load_config(saved))
        ours = anchored(cfg)
        if theirs.model != ours.model:
            held.append(f"config.yaml whose model settings differ, model.name={theirs.model.name}")
        elif theirs.tasks != ours.tasks:
            held.append(f"config.yaml whose tasks differ, tasks.source={theirs.tasks.source}")
    if held:
        raise FileExistsError(
            f"{run_dir} holds another run ({', '.join(held)}); coderl sft writes only into a "
            "new directory or its own earlier one: set run_dir=... to write elsewhere"
        )


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("sft", help="supervised warm start on oracle episodes (training split)")
    p.add_argument("config", help="YAML preset, e.g. configs/default.yaml")
    p.add_argument("overrides", nargs="*", help="key=value overrides")
    p.add_argument("--force", action="store_true", help="replace the run's SFT weights")
    p.set_defaults(func=run)
