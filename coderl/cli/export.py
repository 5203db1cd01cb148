"""`coderl export`: a run's weights as Hugging Face / peft directories (:mod:`coderl.train.export`);
of an online run, its champion or any registry version (:mod:`coderl.online.runfiles`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from coderl.online.runfiles import (
    describe,
    online_source,
    open_online_run,
    pick_version,
    version_status,
)


def is_online(source: str, version: int | None) -> bool:
    """Whether ``source`` names an online run (:func:`coderl.online.runfiles.online_source`);
    ``coderl export`` and ``coderl eval`` then read a registry version.

    Raises:
        ValueError: ``version`` (``--version``) for any other source.
    """
    if online_source(source):
        return True
    if version is not None:
        raise ValueError(
            f"--version: {source} is not an online run (no registry/); name a checkpoint "
            "directory instead (RUN_DIR/checkpoints/step-N)"
        )
    return False


def add_source(p: argparse.ArgumentParser, name: str, what: str) -> None:
    """The source argument ``name`` of ``coderl export`` / ``eval`` (``what``: the training
    sources it takes) and ``--version``."""
    online = (
        "an online run's directory (its champion) or registry version (RUN/registry/versions/N)"
    )
    p.add_argument(name, help=f"{what}, or {online}")
    p.add_argument(
        "--version",
        type=int,
        metavar="N",
        help="online runs: registry version N instead of the champion",
    )


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
    if is_online(args.run_dir, args.version):
        manifest = _export_online(args)
    else:
        if args.merged and full_fine_tuning(args.run_dir):
            raise ValueError(
                "--merged: this run fine-tuned every weight; there is no adapter to merge"
            )
        from coderl.train.export import export_run

        manifest = export_run(args.run_dir, args.out, merged=args.merged, force=args.force)
    for role, path in manifest["dirs"].items():
        gap = manifest["checks"][role]["max_logprob_gap"]
        print(f"{role}: {path} (max logprob gap {gap:.2g} nats)")
    return 0


def _export_online(args: argparse.Namespace) -> dict[str, Any]:
    """Export an online run's registry version (``--version``, else its shared champion);
    refusals come before the model loads."""
    from coderl.config import load_config

    run = open_online_run(args.run_dir)
    version, vdir = pick_version(run, args.version)
    cfg = load_config(run.config, ["trainer.device=cpu", f"run_dir={run.run_dir}"])
    if args.merged and not cfg.model.lora:
        raise ValueError("--merged: this run fine-tuned every weight; there is no adapter to merge")
    print(f"exporting {describe(run, version)}", file=sys.stderr, flush=True)
    from coderl.online.cycle import load_version_into
    from coderl.policy.local import LocalPolicy
    from coderl.train.export import export_weights

    def load(policy: LocalPolicy) -> dict[str, Any]:
        load_version_into(policy.model, cfg, run.registry, version)
        return {"registry_version": version, "status": version_status(run, version)}

    return export_weights(
        cfg, run.run_dir, vdir, load, args.out, merged=args.merged, force=args.force
    )


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("export", help="a run's weights as Hugging Face / peft directories")
    add_source(p, "run_dir", "a run directory (its newest checkpoint), a checkpoint")
    p.add_argument("--out", help="output directory (default RUN_DIR/export)")
    p.add_argument(
        "--merged", action="store_true", help="LoRA runs: also write base + adapter merged"
    )
    p.add_argument(
        "--force", action="store_true", help="replace a previous export (never a run directory)"
    )
    p.set_defaults(func=run)
