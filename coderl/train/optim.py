"""Optimizer and learning-rate schedule of the trainer (AdamW + warm-up + decay)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

from coderl.config import TrainerConfig


def _constant(progress: float) -> float:
    return 1.0


def _linear(progress: float) -> float:
    return max(0.0, 1.0 - progress)


def _cosine(progress: float) -> float:
    return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


# schedule name -> LR multiplier as a function of decay progress in [0, 1]; the only dispatch point
SCHEDULES: dict[str, Callable[[float], float]] = {
    "constant": _constant,
    "linear": _linear,
    "cosine": _cosine,
}


def lr_multiplier(step: int, cfg: TrainerConfig) -> float:
    """LR multiplier after ``step`` optimizer steps: linear warm-up to 1 over ``warmup_steps``,
    then ``SCHEDULES[cfg.schedule]`` of the decay progress (cosine: Loshchilov & Hutter 2017,
    SGDR, Eq. 5 without restarts).

    Raises:
        ValueError: unknown schedule (lists the valid ones).
    """
    if cfg.schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {cfg.schedule!r}; valid: {sorted(SCHEDULES)}")
    if step < cfg.warmup_steps:
        return (step + 1) / (cfg.warmup_steps + 1)
    total = max(cfg.steps * cfg.update_epochs - cfg.warmup_steps, 1)
    return SCHEDULES[cfg.schedule]((step - cfg.warmup_steps) / total)


def build_optimizer(
    param_groups: Iterable[dict[str, object]], cfg: TrainerConfig
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW (Loshchilov & Hutter 2019) over ``param_groups`` and its LambdaLR schedule.

    Each group may set its own ``lr``; the schedule multiplies every group's base LR.
    """
    groups = [dict(g) for g in param_groups]
    for g in groups:
        g.setdefault("lr", cfg.lr)
    opt = torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=cfg.weight_decay)  # type: ignore[arg-type]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_multiplier(s, cfg))
    return opt, sched
