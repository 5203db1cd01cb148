"""`coderl export`: a run's weights as Hugging Face / peft directories (:mod:`coderl.train.export`)."""

from __future__ import annotations

import argparse

from coderl.train.export import export_run


def run(args: argparse.Namespace) -> int:
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
    p.add_argument("--force", action="store_true", help="replace an existing output directory")
    p.set_defaults(func=run)
