"""``coderl train --resume RUN``: continue a run with the config it was started with.

The run's own ``RUN/config.yaml`` is the base; a preset named with ``--resume`` and ``key=value``
overrides are applied on top of it, and every key they change is printed. A change to what the
checkpoint holds (:data:`FROZEN`: the model and its LoRA shape, the advantage estimator and so
the value head, the optimizer's learning rates, the task source behind the data cursor) is
refused: the run would silently go on with the checkpoint's values or fail half-way.
``config.yaml`` is rewritten only after the resume is validated, and only together with a line
in ``RUN/resume.jsonl`` recording what changed (step, time, ``{key: [old, new]}``).

Not checked: a change that is allowed here but makes the continued run differ from an
uninterrupted one (``seed``, ``rollout.*``...) is the user's choice; it is printed, not refused.
"""

from __future__ import annotations

import json
import shlex
import time
from pathlib import Path
from typing import Any

from coderl.config import (
    Config,
    ConfigError,
    anchored,
    apply_override,
    build_config,
    dump_config,
    load_tree,
)
from coderl.rundir import SFT_WEIGHTS, ensure_not_live, not_started_line
from coderl.train.checkpoint import (
    CKPT_PREFIX,
    incomplete_note,
    latest_checkpoint,
    list_checkpoints,
    newest_intact,
    verify_checkpoint,
)

FROZEN = (
    "model.",
    "algorithm.advantage",
    "algorithm.value_lr",
    "trainer.lr",
    "trainer.weight_decay",
    "tasks.source",
    "tasks.mix",
)
"""Dotted keys (a trailing ``.``: a whole section) whose value the checkpoint holds."""

RESUME_LOG = "resume.jsonl"


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (lists and other values are leaves)."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(flatten(value, f"{prefix}{key}." if isinstance(value, dict) else prefix + key))
    return out


def config_changes(old: Config, new: Config) -> dict[str, tuple[Any, Any]]:
    """``{dotted key: (old, new)}`` for every leaf that differs, ``run_dir`` left out."""
    a, b = (flatten(c.model_dump(by_alias=True)) for c in (old, new))
    keys = [k for k in {**a, **b} if k != "run_dir" and a.get(k) != b.get(k)]
    return {k: (a.get(k), b.get(k)) for k in keys}


def _merge(base: dict[str, Any], top: dict[str, Any]) -> None:
    """Deep-merge ``top`` into ``base`` in place (sections merge, values replace)."""
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value


RESUMERS = {False: "coderl train", True: "coderl train-async"}
"""Whether a checkpoint was written asynchronously (its ``state.json`` holds the task ledger of
:mod:`coderl.asyncrl`) -> the command that continues it."""


def resume_config(
    run_dir: str | Path,
    preset: str | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    command: str = "coderl train",
) -> tuple[Config, dict[str, tuple[Any, Any]], int]:
    """The config to continue ``run_dir`` with, what it changes, and the checkpoint's step.
    ``run_dir`` may name one of the run's checkpoints instead (:func:`resume_target`): the run
    continues from it, and :func:`record_resume` sets the newer ones aside. ``command`` is the
    one resuming (a value of :data:`RESUMERS`).

    Raises:
        ValueError: the run was written by the other command of :data:`RESUMERS` (a
            ``train-async`` run resumed synchronously would drop its task ledger; names the
            command that continues it).
        FileNotFoundError: no ``config.yaml`` or no complete checkpoint in ``run_dir``.
        coderl.train.checkpoint.DamagedCheckpoint: the checkpoint is damaged (names the newest
            intact one).
        ConfigError: an override changes a :data:`FROZEN` key or ``run_dir``, or turns
            ``tasks.synth.enabled`` off (the checkpoint's pool holds the synthesised tasks; turning
            it on is allowed); ``trainer.steps``
            is not above the checkpoint's step; any validation error.
    """
    run_dir, ckpt = resume_target(run_dir)
    saved = run_dir / "config.yaml"
    if not saved.is_file():
        raise FileNotFoundError(f"--resume {run_dir}: no config.yaml (not a coderl train run)")
    state = json.loads((ckpt / "state.json").read_text())
    step, writer = state["step"], RESUMERS["ledger" in state]
    if writer != command:
        raise ValueError(
            f"--resume {run_dir}: the run was written by `{writer}` (its checkpoint "
            f"{'holds a' if 'ledger' in state else 'has no'} task ledger); continue it with: "
            f"{writer} --resume {shlex.quote(str(run_dir))}"
        )
    tree = load_tree(saved)
    if preset is not None:
        top = load_tree(preset)
        top.pop("run_dir", None)  # --resume names the run
        _merge(tree, top)
    for ov in overrides:
        if ov.partition("=")[0].strip() == "run_dir":
            raise ConfigError(f"run_dir: --resume {run_dir} names the run; drop {ov!r}")
        apply_override(tree, ov)
    tree["run_dir"] = str(run_dir)
    cfg = anchored(build_config(tree))  # a preset's relative task file, as config.yaml holds it
    changes = config_changes(build_config(load_tree(saved)), cfg)
    frozen = [k for k in changes if k.startswith(FROZEN) or k in FROZEN]
    if changes.get("tasks.synth.enabled") == (True, False):
        frozen.append("tasks.synth.enabled")  # the synthesised tasks live in the pool's state
    if frozen:
        said = ", ".join(f"{k} {changes[k][0]!r} -> {changes[k][1]!r}" for k in frozen)
        raise ConfigError(
            f"--resume {run_dir}: {said} would change what the checkpoint holds (weights, value "
            "head, optimizer, data cursor); start a new run with run_dir=... instead"
        )
    if cfg.trainer.steps <= step:
        raise ConfigError(
            f"--resume {run_dir}: the run is at step {step} and trainer.steps="
            f"{cfg.trainer.steps}; give trainer.steps=N (N > {step}) to train further"
        )
    return cfg, changes, step


def resume_target(path: str | Path) -> tuple[Path, Path]:
    """``(run_dir, checkpoint)`` that ``--resume PATH`` continues: PATH is a run directory (its
    newest checkpoint) or one of its checkpoints (``RUN/checkpoints/step-000004``, e.g. the
    intact one a damaged newer one names).

    Raises:
        coderl.rundir.RunDirBusy: the run is live (another process holds its lock).
        FileNotFoundError: PATH is neither; or it holds only ``coderl sft`` output (the line
            says so and gives the ``coderl train`` command that starts RL from it).
        coderl.train.checkpoint.DamagedCheckpoint: that checkpoint is damaged.
    """
    path = Path(path)
    named = (path / "state.json").is_file() and path.parent.name == "checkpoints"
    ensure_not_live(path.parent.parent if named else path)  # live: not "no checkpoint"
    if named:
        run_dir, ckpt = path.parent.parent, path
    else:
        if (path / SFT_WEIGHTS).is_file() and not list_checkpoints(path):
            start = shlex.join(
                [
                    "coderl",
                    "train",
                    str(path / "config.yaml"),
                    f"run_dir={path}",
                    "sft.enabled=true",
                ]
            )
            raise FileNotFoundError(
                f"--resume {path}: it holds an SFT warm start ({SFT_WEIGHTS}) and no RL "
                f"checkpoint to resume; start RL from the SFT weights with: {start}"
            )
        run_dir, ckpt = path, latest_checkpoint(path)
    verify_checkpoint(ckpt)
    return run_dir, ckpt


def set_aside_newer(run_dir: str | Path, step: int) -> list[Path]:
    """Move the checkpoints of ``run_dir`` newer than ``step`` to ``checkpoints/superseded/``
    (kept, not deleted: a run resumed from an older checkpoint would otherwise be outranked by
    them); returns where they went."""
    moved = []
    for ckpt in list_checkpoints(run_dir):
        if int(ckpt.name[len(CKPT_PREFIX) :]) > step:
            aside = ckpt.parent / "superseded" / ckpt.name
            n = 1
            while aside.exists():
                n += 1
                aside = ckpt.parent / "superseded" / f"{ckpt.name}.{n}"
            aside.parent.mkdir(exist_ok=True)
            ckpt.rename(aside)
            moved.append(aside)
    return moved


def record_resume(cfg: Config, changes: dict[str, tuple[Any, Any]], step: int) -> list[str]:
    """Set aside the checkpoints newer than ``step`` (:func:`set_aside_newer`: the run was
    resumed from an older one), and write the resumed config to ``config.yaml`` with a
    ``resume.jsonl`` line of what changed (nothing when nothing changed); returns one printable
    line for the checkpoint it starts from (and the newer incomplete ones it skips), then one
    per change or checkpoint set aside."""
    aside = [f"resume: {p.name} set aside to {p}" for p in set_aside_newer(cfg.run_dir, step)]
    used = latest_checkpoint(cfg.run_dir)  # the one restore loads
    note = incomplete_note(cfg.run_dir, used)
    aside.insert(0, f"resume: from {used} (step {step})" + (f"; {note}" if note else ""))
    if not changes:
        return aside
    run_dir = Path(cfg.run_dir)
    row = {"step": step, "time": time.time(), "changes": {k: list(v) for k, v in changes.items()}}
    with (run_dir / RESUME_LOG).open("a") as f:
        f.write(json.dumps(row) + "\n")
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    return aside + [f"resume: {k} {old!r} -> {new!r}" for k, (old, new) in changes.items()]


def stopped_line(command: str, run_dir: str | Path, resume: str, again: str | None = None) -> str:
    """One line for an interrupted run: its last checkpoint and the command that resumes it;
    before the first checkpoint, that there is nothing to resume and, where one is given, the
    command ``again`` that starts the run over."""
    last = newest_intact(run_dir)
    if last is None:
        return not_started_line(command, run_dir, again)
    step = json.loads((last / "state.json").read_text()).get("step", "?")
    return f"{command}: interrupted; last checkpoint {last} (step {step}); resume with: {resume}"
