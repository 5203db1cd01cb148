"""Checkpoints: trainable weights (safetensors), optimizer, scheduler, RNG states, data cursor,
step. Written to a temporary directory and renamed into place, so a run killed at any moment
(``kill -9``) leaves only complete checkpoints behind.

Layout of ``RUN_DIR/checkpoints/step-000012/``::

    trainable.safetensors   parameters with requires_grad (the LoRA adapter, or every weight)
    value_head.safetensors  PPO value head (when there is one)
    optimizer.pt            optimizer.state_dict()
    scheduler.pt            scheduler.state_dict()
    rng.pt                  Python, NumPy and torch RNG states
    state.json              step, policy version, data cursor, anything else JSON-serialisable
    manifest.json           every other file's size and SHA-256, written last

Verified when written (the weights are read back and compared, the manifest hashes what is on
disk) and when read (:func:`verify_checkpoint`, by :func:`load_checkpoint` and ``--resume``): a
damaged checkpoint (a truncated or altered file, a disk that filled up) is named in one line
together with the newest intact checkpoint of the run, which ``coderl train --resume``,
``coderl eval`` and ``coderl export`` accept in place of the run directory. A checkpoint written
before manifests existed is read unverified.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn

# the run directory's layout and the new-run check live in coderl.rundir (no torch there)
from coderl.rundir import CKPT_PREFIX as CKPT_PREFIX
from coderl.rundir import ensure_new_run as ensure_new_run
from coderl.rundir import honour_umask
from coderl.rundir import list_checkpoints as list_checkpoints

MANIFEST = "manifest.json"


class DamagedCheckpoint(ValueError):
    """A checkpoint's files do not match its manifest (a ``ValueError``: the command line
    prints it as one line); the message names the newest intact checkpoint of the run."""


def sha256_file(path: Path) -> str:
    """The SHA-256 of the file ``path`` (hex), read in 1 MiB blocks."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_manifest(ckpt: str | Path) -> None:
    """Write ``manifest.json``: the size and SHA-256 of every other file under ``ckpt``
    (recursively: a sharded checkpoint's ``dcp/`` too), hashed from the disk."""
    ckpt = Path(ckpt)
    files = {
        str(p.relative_to(ckpt)): {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
        for p in sorted(ckpt.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }
    (ckpt / MANIFEST).write_text(json.dumps({"files": files}, indent=1))


def checkpoint_damage(ckpt: str | Path) -> str | None:
    """What is wrong with checkpoint ``ckpt`` (the first file that is missing, of another size
    or another hash than its manifest says), or None when it is intact or has no manifest
    (written before manifests existed: not verifiable)."""
    ckpt = Path(ckpt)
    if not (ckpt / MANIFEST).is_file():
        return None
    try:
        files = json.loads((ckpt / MANIFEST).read_text())["files"]
    except (ValueError, KeyError, TypeError):
        return f"{MANIFEST} is unreadable"
    for name, want in files.items():
        p = ckpt / name
        if not p.is_file():
            return f"{name} is missing"
        if p.stat().st_size != want["bytes"]:
            return f"{name} has {p.stat().st_size} bytes, {want['bytes']} were written"
        if sha256_file(p) != want["sha256"]:
            return f"{name} differs from what was written (SHA-256)"
    return None


def newest_intact(run_dir: str | Path) -> Path | None:
    """The newest checkpoint of ``run_dir`` that :func:`checkpoint_damage` finds intact."""
    for ckpt in reversed(list_checkpoints(run_dir)):
        if checkpoint_damage(ckpt) is None:
            return ckpt
    return None


def verify_checkpoint(ckpt: str | Path) -> None:
    """Check ``ckpt`` against its manifest.

    Raises:
        DamagedCheckpoint: it is damaged; one line naming what is wrong and the newest intact
            checkpoint of the same run (or that there is none).
    """
    ckpt = Path(ckpt)
    what = checkpoint_damage(ckpt)
    if what is None:
        return
    good = newest_intact(ckpt.parent.parent)
    if good is None:
        raise DamagedCheckpoint(
            f"checkpoint {ckpt} is damaged ({what}); no intact one is left, so the run cannot "
            f"be resumed: start it again with run_dir=... set to a new directory (the logs in "
            f"{ckpt.parent.parent} are kept)"
        )
    raise DamagedCheckpoint(
        f"checkpoint {ckpt} is damaged ({what}); the newest intact one is {good}: give it "
        f"instead of the run directory (coderl train --resume {good}, coderl eval {good}, "
        f"coderl export {good} ...)"
    )


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters that require grad, by name (contiguous CPU copies)."""
    return {
        n: p.detach().cpu().contiguous().clone()
        for n, p in model.named_parameters()
        if p.requires_grad
    }


def check_trainable(shapes: dict[str, torch.Size], tensors: dict[str, torch.Tensor]) -> None:
    """Check that ``tensors`` holds exactly the trainable parameters named in ``shapes`` (name ->
    the parameter's full shape), each with its shape.

    Raises:
        ValueError: a trainable parameter is missing from ``tensors`` or an extra name is present
            (names both lists' first entries), or a shape differs.
    """
    missing, extra = sorted(set(shapes) - set(tensors)), sorted(set(tensors) - set(shapes))
    if missing or extra:
        raise ValueError(
            f"checkpoint does not match the model: missing {missing[:3]} extra {extra[:3]}"
        )
    for n, shape in shapes.items():
        if shape != tensors[n].shape:
            raise ValueError(f"{n}: checkpoint shape {tuple(tensors[n].shape)} != {tuple(shape)}")


def load_trainable(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy ``tensors`` into the model's trainable parameters.

    Raises:
        ValueError: as :func:`check_trainable`.
    """
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    check_trainable({n: p.shape for n, p in params.items()}, tensors)
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(tensors[n].to(p.dtype))


def rng_state() -> dict[str, Any]:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def save_verified(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Write ``tensors`` as safetensors and read them back.

    Raises:
        OSError: the file read back differs from ``tensors`` (a full disk, a failing device).
    """
    save_file(tensors, str(path))
    honour_umask(path)  # safetensors leaves its temporary file's 0600
    back = load_file(str(path))
    if back.keys() != tensors.keys() or not all(
        torch.equal(back[k], v) for k, v in tensors.items()
    ):
        raise OSError(f"{path}: the weights read back differ from the weights written")


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    state: dict[str, Any],
    value_head: nn.Module | None = None,
    keep: int = 2,
) -> Path:
    """Write checkpoint ``step`` atomically and delete all but the newest ``keep``.

    Returns:
        The checkpoint directory.
    """
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{CKPT_PREFIX}{step:06d}"
    tmp = root / f".tmp-{final.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_verified(trainable_state(model), tmp / "trainable.safetensors")
    if value_head is not None:
        save_verified(trainable_state(value_head), tmp / "value_head.safetensors")
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
    torch.save(rng_state(), tmp / "rng.pt")
    (tmp / "state.json").write_text(json.dumps({**state, "step": step}, indent=1))
    write_manifest(tmp)  # last: it hashes what is on disk
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def incomplete_newer(run_dir: str | Path, used: Path | None) -> list[Path]:
    """The ``checkpoints/step-N`` directories of ``run_dir`` without a ``state.json`` (a save
    that did not finish: ``save_checkpoint`` writes it last, then renames) that are newer than
    ``used`` (all of them when None), oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    floor = -1 if used is None else _step_of(used)
    found = [
        p
        for p in root.glob(f"{CKPT_PREFIX}*")
        if p.is_dir() and not (p / "state.json").is_file() and _step_of(p) > floor
    ]
    return sorted(found, key=_step_of)


def _step_of(ckpt: Path) -> int:
    tail = ckpt.name[len(CKPT_PREFIX) :]
    return int(tail) if tail.isdigit() else -1


def incomplete_note(run_dir: str | Path, used: Path) -> str | None:
    """One line naming the checkpoints newer than ``used`` that are incomplete (skipped) and
    ``used``, the one taken instead; None when there is none."""
    skipped = incomplete_newer(run_dir, used)
    if not skipped:
        return None
    names = ", ".join(str(p) for p in skipped)
    return (
        f"checkpoint {names} is incomplete (no state.json: its save did not finish) and is "
        f"skipped; using {used}"
    )


def latest_checkpoint(run_dir: str | Path) -> Path:
    """The newest complete checkpoint of ``run_dir`` (newer incomplete ones are skipped:
    :func:`incomplete_note` says so).

    Raises:
        FileNotFoundError: ``run_dir`` does not exist, or has no complete checkpoint (naming
            the incomplete ones, if any).
    """
    if Path(run_dir).is_file():
        raise FileNotFoundError(
            f"{run_dir} is a file, not a run directory or a checkpoint (a config? `coderl train "
            f"{run_dir}` makes a run)"
        )
    if not Path(run_dir).is_dir():
        raise FileNotFoundError(f"{run_dir} does not exist (give a run directory or a checkpoint)")
    ckpts = list_checkpoints(run_dir)
    if not ckpts:
        bad = incomplete_newer(run_dir, None)
        said = f" ({bad[-1]} is incomplete: no state.json, its save did not finish)" if bad else ""
        raise FileNotFoundError(f"{run_dir}: no complete checkpoint under checkpoints/{said}")
    return ckpts[-1]


def resolve_checkpoint(path: str | Path) -> tuple[Path, Path]:
    """``(run_dir, checkpoint)`` of a checkpoint directory or of a run directory (then its newest
    complete checkpoint, with :func:`incomplete_note`'s line on stderr when a newer one is
    incomplete; a run of ``coderl sft`` alone: its ``sft/`` weights, which hold no optimizer
    state); what ``coderl eval`` and ``coderl export`` accept.

    Raises:
        FileNotFoundError: ``path`` does not exist, or is neither a complete checkpoint nor a
            run with one (:func:`latest_checkpoint`).
    """
    ckpt = Path(path)
    if not (ckpt / "state.json").is_file():
        if ckpt.parent.name == "checkpoints" and ckpt.is_dir():  # one checkpoint, named
            good = list_checkpoints(ckpt.parent.parent)
            instead = f"; the newest complete one is {good[-1]}" if good else ""
            raise FileNotFoundError(
                f"checkpoint {ckpt} is incomplete (no state.json: its save did not finish){instead}"
            )
        sft = ckpt / "sft"
        if not list_checkpoints(ckpt) and (sft / "state.json").is_file():
            return ckpt, sft
        ckpt = latest_checkpoint(ckpt)
        note = incomplete_note(path, ckpt)
        if note:
            print(note, file=sys.stderr, flush=True)
    return (ckpt.parent.parent if ckpt.parent.name == "checkpoints" else ckpt.parent), ckpt


def load_checkpoint(
    path: str | Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    value_head: nn.Module | None = None,
    restore_rng: bool = True,
) -> dict[str, Any]:
    """Restore what :func:`save_checkpoint` wrote; returns ``state.json``'s content.

    Raises:
        FileNotFoundError: ``path`` is not a complete checkpoint.
        ValueError: the weights do not match the model, or an optimizer is to be restored from
            a sharded checkpoint (its weights alone load: ``coderl eval`` reads them).
        DamagedCheckpoint: the files differ from the manifest (names the newest intact one).
    """
    path = Path(path)
    if not (path / "state.json").is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no state.json)")
    verify_checkpoint(path)
    if optimizer is not None and (path / "dcp").is_dir():  # coderl.train.distributed's
        raise ValueError(
            f"{path} is a sharded (DCP) checkpoint: resume it with "
            "trainer.distributed.enabled=true under torchrun (any world size, 1 included)"
        )
    load_trainable(model, load_file(str(path / "trainable.safetensors")))
    if value_head is not None:
        load_trainable(value_head, load_file(str(path / "value_head.safetensors")))
    if optimizer is not None:
        optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=False))
    if scheduler is not None:
        scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=False))
    if restore_rng:
        set_rng_state(torch.load(path / "rng.pt", weights_only=False))
    state: dict[str, Any] = json.loads((path / "state.json").read_text())
    return state
