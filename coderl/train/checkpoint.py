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
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn

CKPT_PREFIX = "step-"


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters that require grad, by name (contiguous CPU copies)."""
    return {
        n: p.detach().cpu().contiguous().clone()
        for n, p in model.named_parameters()
        if p.requires_grad
    }


def load_trainable(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy ``tensors`` into the model's trainable parameters.

    Raises:
        ValueError: a trainable parameter is missing from ``tensors`` or an extra name is present
            (names both lists' first entries), or a shape differs.
    """
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    missing, extra = sorted(set(params) - set(tensors)), sorted(set(tensors) - set(params))
    if missing or extra:
        raise ValueError(
            f"checkpoint does not match the model: missing {missing[:3]} extra {extra[:3]}"
        )
    with torch.no_grad():
        for n, p in params.items():
            if p.shape != tensors[n].shape:
                raise ValueError(
                    f"{n}: checkpoint shape {tuple(tensors[n].shape)} != {tuple(p.shape)}"
                )
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
    save_file(trainable_state(model), str(tmp / "trainable.safetensors"))
    if value_head is not None:
        save_file(trainable_state(value_head), str(tmp / "value_head.safetensors"))
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
    torch.save(rng_state(), tmp / "rng.pt")
    (tmp / "state.json").write_text(json.dumps({**state, "step": step}, indent=1))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    done = [p for p in root.glob(f"{CKPT_PREFIX}*") if (p / "state.json").is_file()]
    return sorted(done, key=lambda p: int(p.name[len(CKPT_PREFIX) :]))


def ensure_new_run(run_dir: str | Path) -> None:
    """Refuse to start a fresh run in a directory that already holds checkpoints.

    A new run there would overwrite the old run's logs while older, higher-numbered checkpoints
    outrank its own, so ``--resume`` and ``coderl eval`` would silently pick the old weights.

    Raises:
        FileExistsError: ``run_dir`` holds checkpoints (names them and the way out).
    """
    found = list_checkpoints(run_dir)
    if found:
        raise FileExistsError(
            f"{run_dir} already holds checkpoints of a previous run (latest: {found[-1].name}); "
            "continue it with --resume, or set run_dir=... to start a new run elsewhere"
        )


def latest_checkpoint(run_dir: str | Path) -> Path:
    """The newest complete checkpoint of ``run_dir``.

    Raises:
        FileNotFoundError: the run has no complete checkpoint.
    """
    ckpts = list_checkpoints(run_dir)
    if not ckpts:
        raise FileNotFoundError(f"{run_dir}: no complete checkpoint under checkpoints/")
    return ckpts[-1]


def resolve_checkpoint(path: str | Path) -> tuple[Path, Path]:
    """``(run_dir, checkpoint)`` of a checkpoint directory or of a run directory (then its newest
    checkpoint); what ``coderl eval`` and ``coderl export`` accept.

    Raises:
        FileNotFoundError: ``path`` is neither a complete checkpoint nor a run with one.
    """
    ckpt = Path(path)
    if not (ckpt / "state.json").is_file():
        ckpt = latest_checkpoint(ckpt)
    return ckpt.parent.parent, ckpt


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
    """
    path = Path(path)
    if not (path / "state.json").is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no state.json)")
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
