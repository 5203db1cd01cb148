"""The ``logging`` section: metric sinks beside ``metrics.jsonl`` and TensorBoard."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from coderl.config._base import _Section


class WandbConfig(_Section):
    enabled: bool = False
    """Also log every step's metrics and each evaluation to Weights & Biases (needs the
    ``wandb`` package: ``pip install 'coderl[wandb]'``)."""
    project: str | None = None
    """W&B project of the run (None: ``$WANDB_PROJECT``, else ``coderl``)."""
    mode: Literal["offline", "online", "disabled"] | None = None
    """``offline``: write the W&B run under ``run_dir/wandb`` (or ``$WANDB_DIR``) only, to upload
    later with ``wandb sync``; ``online``: stream to the W&B server (needs a login);
    ``disabled``: no W&B run. None: ``$WANDB_MODE``, else ``offline``."""
    name: str | None = None
    """W&B run name (None: the run directory's name)."""


class LoggingConfig(_Section):
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    """Weights & Biases logging."""
