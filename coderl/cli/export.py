"""`coderl export`: a run's weights as Hugging Face / peft directories (:mod:`coderl.train.export`)."""

from __future__ import annotations

import argparse
from pathlib import Path


def full_fine_tuning(source: str) -> bool:
    """Whether the run of ``source`` (a run directory, one of its checkpoints or its ``sft/``)
    fine-tuned every weight, read from its ``config.yaml`` alone: ``--merged`` is refused in a
    second, before torch and the model load (:func:`coderl.train.export.export_run` checks it
    again). False where no ``config.yaml`` is found (export says what is missing)."""
    from coderl.config import load_config

    here = Path(source)
    for d in (here, here.parent, here.parent.parent):
        if (d / "config.yaml").is_file():
            return not load_config(d / "config.yaml", ["trainer.device=cpu"]).model.lora
    return False


def run(args: argparse.Namespace) -> int:
    if args.merged and full_fine_tuning(args.run_dir):
        raise ValueError("--merged: this run fine-tuned every weight; there is no adapter to merge")
    from coderl.train.export import export_run

    manifest = export_run(args.run_dir, args.out, merged=args.merged, force=args.force)
    for role, path in manifest["dirs"].items():
        gap = manifest["checks"][role]["max_logprob_gap"]
        print(f"{role}: {path} (max logprob gap {gap:.2g} nats)")
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("export", help="a run's weights as Hugging Face / peft directories")
    p.add_argument("run_dir", help="a run directory (its newest checkpoint) or a checkpoint")
    p.add_argument("--out", help="output directory (default RUN_DIR/export)")
    p.add_argument(
        "--merged", action="store_true", help="LoRA runs: also write base + adapter merged"
    )
    p.add_argument(
        "--force", action="store_true", help="replace a previous export (never a run directory)"
    )
    p.set_defaults(func=run)
