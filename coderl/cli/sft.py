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
from typing import Any

from coderl.config import Config, anchored, dump_config, load_config
from coderl.rundir import SFT_WEIGHTS, existing_logs, list_checkpoints, run_lock


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
        from coderl.policy.threads import use_threads
        from coderl.train.warmstart import warm_start  # torch: after the refusals

        use_threads(cfg.threads)
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
    if not held and (other := other_config(run_dir, cfg, ("model", "tasks"))):
        held.append(other)
    if held:
        raise FileExistsError(
            f"{run_dir} holds another run ({', '.join(held)}); coderl sft writes only into a "
            "new directory or its own earlier one: set run_dir=... to write elsewhere"
        )


def other_config(run_dir: Path, cfg: Config, sections: tuple[str, ...]) -> str | None:
    """How ``run_dir/config.yaml`` differs from ``cfg`` in the first of ``sections`` that
    differs (``"config.yaml whose model settings differ, model.name=X"``), or None when it
    does not (or there is none)."""
    saved = run_dir / "config.yaml"
    if not saved.is_file():
        return None
    theirs, ours = anchored(load_config(saved)), anchored(cfg)
    said = {"model": f", model.name={theirs.model.name}"}
    said["tasks"] = f", tasks.source={theirs.tasks.source}"
    for name in sections:
        if getattr(theirs, name) != getattr(ours, name):
            return f"config.yaml whose {name} settings differ{said.get(name, '')}"
    return None


SFT_INPUTS = (
    "model",
    "sft",
    "seed",
    "tasks.source",
    "tasks.mix",
    "tasks.train_split",
    "tasks.limit",
    "tasks.options",
)
"""The keys SFT weights depend on (the model, the demonstrations, the SFT settings; not
whether SFT is enabled or cached): equal ones let ``coderl train`` start from a run's weights."""


def _setting(cfg: Config, key: str) -> Any:
    value: Any = cfg
    for part in key.split("."):
        value = getattr(value, part)
    if key == "sft":  # coderl sft runs whether or not it is enabled; the cache is no input
        value = value.model_copy(update={"enabled": True, "cache": False})
    return value


def reuse_sft(run_dir: Path, cfg: Config) -> bool:
    """Whether ``coderl train`` starts RL from the SFT weights already in ``run_dir`` (a
    ``coderl sft``, or a run stopped after its warm start, of the same :data:`SFT_INPUTS`)
    instead of running the warm start again; False when there are none or the run has no
    ``config.yaml`` to compare with.

    Raises:
        FileExistsError: the weights are of other inputs (one line: which, and the ways out).
    """
    saved = run_dir / "config.yaml"
    if not (run_dir / SFT_WEIGHTS).is_file() or not saved.is_file():
        return False
    theirs, ours = anchored(load_config(saved)), anchored(cfg)
    differ = [k for k in SFT_INPUTS if _setting(theirs, k) != _setting(ours, k)]
    if differ:
        raise FileExistsError(
            f"{run_dir} holds SFT weights of another config ({', '.join(differ)} differ from "
            f"its config.yaml); set run_dir=... to start elsewhere, or delete "
            f"{run_dir / 'sft'} to run the warm start again"
        )
    return True


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("sft", help="supervised warm start on oracle episodes (training split)")
    p.add_argument("config", help="YAML preset, e.g. configs/default.yaml")
    p.add_argument("overrides", nargs="*", help="key=value overrides")
    p.add_argument("--force", action="store_true", help="replace the run's SFT weights")
    p.set_defaults(func=run)
