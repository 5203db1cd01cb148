"""Sharded data-parallel training on PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``).

Launch every rank with ``torchrun`` (it sets ``RANK``, ``WORLD_SIZE`` and the rendezvous)::

    torchrun --nproc-per-node 2 -m coderl train configs/toy.yaml trainer.distributed.enabled=true

Sharding (:func:`shard_policy`): every decoder layer is its own FSDP unit, and a root unit,
:class:`ShardedPolicy`, holds the rest (embeddings, final norm, the LM head, which the tiny and
SmolLM2 models tie to the embeddings, and the PPO value head). The trainer's forward
(:func:`coderl.policy.forward.forward`) calls ``lm.model``, ``lm.lm_head`` and the value head
directly rather than the model's own ``forward``; it therefore runs *inside* the root unit's
forward, so the root's hooks gather those parameters first and every direct call sees plain
tensors. Parameters, gradients and the optimizer state are sharded across the ranks (``Shard(0)``
on a 1-D device mesh).

Reduction: each rank takes a contiguous share of the rows of the step's global batch
(:func:`rank_rows`) and scales its micro-batch losses by their share of the *global* normaliser
(tokens, non-empty rows or rows per ``algorithm.loss_agg``, summed over the ranks), and FSDP's
reduce-scatter *sums* the ranks' gradients: ``set_gradient_divide_factor(1.0)`` with
``set_force_sum_reduction_for_comms(True)`` (plain ``SUM``, no division). The reduced gradient is
then the single-process gradient of the global batch, token-mean over the global batch and not
a mean of per-rank means (tests/test_distributed.py checks it against one process).

Rollouts (``trainer.distributed.split_rollouts``, on by default; weights gathered with
:func:`gathered`): each rank rolls out and grades only its contiguous share of a round's task
groups (:func:`rank_share`), each group its own rollout call with its own seed, and the ranks
exchange the graded episodes (:func:`gather`, ``all_gather_object``), so every rank rewards the
whole round and builds the global batch one process would (:func:`coderl.train.loop.rollout_round`);
held-out evaluations split their batches of tasks the same way. Off: every rank runs the whole
step's rollouts, the same ones from the same seeds.

Limits: with split rollouts, the reward terms, the reference logprobs and the PPO values of the
whole batch, vineppo's continuation grading and the pool pre-pass still run on every rank (only
rollouts and grading are split); the ranks compare their rewards of each round
(:func:`check_same_on_ranks`) and stop if they differ. A rank batches only within a group. The
full fine-tuning reference copy is a full frozen copy on every rank (not sharded). The vLLM
engine is not supported in a sharded run (each rank would start its own server). Only models of
:data:`coderl.policy.kvcache.STATIC_MODEL_TYPES` (Llama layout: ``model.layers``) are sharded
per layer.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from coderl.config import AlgorithmConfig, DistributedConfig, TrainerConfig
from coderl.policy.batch import TrainBatch
from coderl.policy.forward import ForwardOut, forward
from coderl.policy.kvcache import causal_lm
from coderl.rundir import honour_umask
from coderl.train.batch import StepBatch
from coderl.train.checkpoint import (
    CKPT_PREFIX,
    check_trainable,
    list_checkpoints,
    rng_state,
    set_rng_state,
    verify_checkpoint,
    write_manifest,
)
from coderl.train.step import DataParallel, train_step

T = TypeVar("T")


@dataclass
class World:
    """This process's place in the sharded run."""

    rank: int
    size: int
    mesh: DeviceMesh


def init_distributed(cfg: DistributedConfig, device: torch.device) -> World:
    """Join the process group ``torchrun`` set up (``env://``: ``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``) and build the 1-D device mesh of all ranks; idempotent.

    Raises:
        RuntimeError: not started by ``torchrun`` (no ``WORLD_SIZE`` in the environment), or
            ``nccl`` asked for on a CPU trainer.
    """
    if not dist.is_initialized():
        if "WORLD_SIZE" not in os.environ:
            raise RuntimeError(
                "trainer.distributed.enabled needs the environment torchrun sets; launch with "
                "`torchrun --nproc-per-node N -m coderl train ...`"
            )
        backend = cfg.backend
        if backend == "auto":
            backend = "nccl" if device.type == "cuda" else "gloo"
        if backend == "nccl" and device.type != "cuda":
            raise RuntimeError("trainer.distributed.backend=nccl needs a CUDA trainer device")
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=timedelta(minutes=cfg.timeout_min))
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    return World(rank=dist.get_rank(), size=dist.get_world_size(), mesh=mesh)


class ShardedPolicy(nn.Module):
    """The root FSDP unit: the policy (peft-wrapped or not) and the PPO value head, with the
    trainer's forward as its ``forward`` (see the module docstring for why)."""

    def __init__(self, model: nn.Module, value_head: nn.Module | None = None):
        super().__init__()
        self.model = model
        self.value_head = value_head

    def forward(  # type: ignore[override]
        self, tokens: TrainBatch, **kwargs: Any
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """:func:`coderl.policy.forward.forward` of ``self.model`` as a tuple ``(logp [B, T],
        entropy [B, T], values [B, T] or None)`` (FSDP finds the outputs it hooks in a tuple);
        the unpacked shared-prefix path is off (one decoder call per forward on every rank)."""
        out = forward(self.model, tokens, share_prefix=False, **kwargs)
        return out.logp, out.entropy, out.values

    def scored(self, _model: nn.Module, tokens: TrainBatch, **kwargs: Any) -> ForwardOut:
        """:func:`coderl.policy.forward.forward`'s signature through the sharded root (the
        first argument is ignored: the root holds the model); for :class:`DataParallel`."""
        logp, entropy, values = self(tokens, **kwargs)
        return ForwardOut(logp=logp, entropy=entropy, values=values)


def shard_policy(model: nn.Module, value_head: nn.Module | None, mesh: DeviceMesh) -> ShardedPolicy:
    """Shard ``model`` (and ``value_head``) in place over ``mesh``: each decoder layer one FSDP
    unit, the root :class:`ShardedPolicy` the rest; gradients are summed, not averaged (see
    the module docstring). Build the optimizer *after* this: the parameters are replaced by
    sharded DTensor parameters.

    Raises:
        ValueError: the model has no ``model.layers`` (not a Llama-layout causal LM).
    """
    lm = causal_lm(model)
    layers = getattr(getattr(lm, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"{type(lm).__name__} has no model.layers to shard")
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    root = ShardedPolicy(model, value_head)
    fully_shard(root, mesh=mesh)
    # FSDP picks its root at the first forward it sees; a direct call of a layer (the sampler,
    # the LoRA reference under gathered()) before any root forward would make each layer a
    # root of its own, so initialise now (FSDP's own lazy init, which no public call exposes)
    root._get_fsdp_state()._lazy_init()  # type: ignore[operator]
    for m in root.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
    return root


@contextmanager
def gathered(root: ShardedPolicy) -> Iterator[None]:
    """Every parameter unsharded (all-gathered, plain tensors) while the block runs, so code
    that calls submodules directly (the sampler, the LoRA reference) sees whole weights; each
    rank holds a full copy meanwhile. Every rank must enter it (a collective). Gradients are
    not involved: use it under ``torch.no_grad()``."""
    units = [m for m in root.modules() if isinstance(m, FSDPModule)]
    for m in units:
        m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    try:
        yield
    finally:
        for m in units:
            m.reshard()
        for m in units[1:]:  # decoder layers; the root (first) keeps FSDP's own False
            m.set_reshard_after_forward(True, recurse=False)


def rank_rows(size: int, rank: int, world: int) -> tuple[int, int]:
    """``(start, stop)``: rank ``rank``'s contiguous share of ``size`` rows; shares differ by
    at most one row, the first ``size % world`` ranks take the larger ones (a rank may get
    none when ``size < world``)."""
    base, extra = divmod(size, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def rank_share(size: int) -> tuple[int, int]:
    """This rank's :func:`rank_rows` of ``size`` items (groups of a round, batches of eval
    tasks)."""
    return rank_rows(size, dist.get_rank(), dist.get_world_size())


def gather(obj: T) -> list[T]:
    """Every rank's ``obj`` (picklable), in rank order; every rank calls it
    (``all_gather_object``: pickled, on NCCL through the current CUDA device)."""
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, obj)
    return parts


def check_same_on_ranks(value: Any, what: str) -> None:
    """Raise unless every rank holds an equal ``value``: what the ranks computed each on their
    own (the rewards of the gathered episodes) must agree, or their batches differ silently.

    Raises:
        RuntimeError: the ranks' values differ (names ``what`` and the first differing rank).
    """
    parts = gather(value)
    for r, v in enumerate(parts):
        if v != parts[0]:
            raise RuntimeError(f"ranks disagree on {what}: rank {r} differs from rank 0")


def _all_reduce(value: float, op: dist.ReduceOp.RedOpType) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return float(t.item())


# metric name -> how the ranks' values combine: losses were scaled by global shares (sum),
# maxima by max, everything else is a mean over each rank's sampled tokens (token-weighted)
_SUMMED = ("loss", "pg_loss", "kl", "entropy", "value_loss")


def _reduce_metrics(metrics: dict[str, float], tokens: float) -> dict[str, float]:
    """The ranks' step metrics combined (see ``_SUMMED``; a rank without rows may lack keys);
    ``tokens``: this rank's sampled tokens. Every rank calls it (one all-gather)."""
    parts = gather((metrics, tokens))
    total = sum(t for _, t in parts)
    out: dict[str, float] = {}
    for k in sorted({k for m, _ in parts for k in m}):
        have = [(m[k], t) for m, t in parts if k in m]
        if k in _SUMMED:
            out[k] = sum(v for v, _ in have)
        elif k.endswith("_max"):
            out[k] = max(v for v, _ in have)
        else:
            out[k] = sum(v * t for v, t in have) / max(total, 1.0)
    return out


def sharded_train_step(
    root: ShardedPolicy,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    batch: StepBatch,
    alg: AlgorithmConfig,
    trainer: TrainerConfig,
    *,
    temperature: float,
    max_len: int,
) -> dict[str, float]:
    """:func:`coderl.train.step.train_step` on this rank's share of the global ``batch`` (every
    rank passes the same global batch; the rows of :func:`rank_rows` are its share).

    Returns:
        ``train_step``'s metrics for the global batch: losses summed over the ranks (each was
        scaled by the global normaliser), maxima their maximum, rates and gaps weighted by
        each rank's sampled tokens (exact for every metric except the rates under masked
        importance sampling, which weight by kept tokens); ``sequences`` and
        ``trained_tokens`` of the global batch; ``grad_norm`` is the global norm.
    """
    start, stop = rank_rows(batch.size, dist.get_rank(), dist.get_world_size())
    share = batch.rows(start, stop)
    dp = DataParallel(
        all_sum=lambda x: _all_reduce(x, dist.ReduceOp.SUM),
        all_max=lambda n: int(_all_reduce(float(n), dist.ReduceOp.MAX)),
        forward=root.scored,
        filler=batch.rows(0, 1),
    )
    m = train_step(
        root,
        optimizer,
        scheduler,
        share,
        alg,
        trainer,
        temperature=temperature,
        max_len=max_len,
        value_head=root.value_head,
        dp=dp,
    )
    fixed = {k: m.pop(k) for k in ("grad_norm", "lr", "optimizer_steps")}
    m.pop("sequences"), m.pop("trained_tokens")
    m = _reduce_metrics(m, float(share.loss_mask.sum()))
    m.update(fixed, sequences=float(batch.size), trained_tokens=float(batch.loss_mask.sum()))
    return m


# --- distributed checkpoints (torch.distributed.checkpoint) ---------------------------------

DCP_DIR = "dcp"
"""The DCP folder inside a checkpoint directory of a sharded run."""
_FROZEN = {"ignore_frozen_params": True}  # trainable weights and their optimizer state only
_OPTIONS = StateDictOptions(**_FROZEN)


def save_sharded_checkpoint(
    run_dir: str | Path,
    step: int,
    *,
    root: ShardedPolicy,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    state: dict[str, Any],
    keep: int = 2,
) -> Path:
    """Write checkpoint ``step`` of a sharded run; every rank calls it (collectives).

    ``dcp/`` holds the trainable weights and the optimizer state as DCP shards
    (``torch.distributed.checkpoint.save`` of
    ``torch.distributed.checkpoint.state_dict.get_state_dict``, frozen weights left out), so a
    run with another world size reads it back (DCP reshards on load). Rank 0 also writes what
    :func:`coderl.train.checkpoint.save_checkpoint` writes apart from the optimizer:
    ``trainable.safetensors`` and ``value_head.safetensors`` (gathered full tensors, for
    ``coderl eval`` and export), ``scheduler.pt``, ``rng.pt`` (rank 0's RNG states, restored on
    every rank: rollouts sample from generators seeded per group or round, not from these) and
    ``state.json`` (with ``world_size``). Written into a temporary directory and renamed into
    place, as the single-process checkpoint is.

    Returns:
        The checkpoint directory.
    """
    root_dir = Path(run_dir) / "checkpoints"
    final = root_dir / f"{CKPT_PREFIX}{step:06d}"
    tmp = root_dir / f".tmp-{final.name}"
    rank0 = dist.get_rank() == 0
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    model_sd, optim_sd = get_state_dict(root, optimizer, options=_OPTIONS)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / DCP_DIR))
    full = get_model_state_dict(
        root, options=StateDictOptions(full_state_dict=True, cpu_offload=True, **_FROZEN)
    )
    if rank0:
        # the names of coderl.train.checkpoint.trainable_state: a tied weight once
        names = {n for n, p in root.named_parameters() if p.requires_grad}
        parts: dict[str, dict[str, Tensor]] = {"model.": {}, "value_head.": {}}
        for name, t in full.items():
            if name in names:
                prefix = "model." if name.startswith("model.") else "value_head."
                parts[prefix][name.removeprefix(prefix)] = t.contiguous().clone()
        save_file(parts["model."], str(tmp / "trainable.safetensors"))
        if parts["value_head."]:
            save_file(parts["value_head."], str(tmp / "value_head.safetensors"))
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        torch.save(rng_state(), tmp / "rng.pt")
        body = {**state, "step": step, "world_size": dist.get_world_size()}
        (tmp / "state.json").write_text(json.dumps(body, indent=1))
        honour_umask(tmp)  # safetensors leaves its temporary file's 0600
        write_manifest(tmp)  # last: every rank's DCP shard is written (dcp.save returned)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for old in list_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def load_full_trainable(root: ShardedPolicy, tensors: dict[str, Tensor]) -> None:
    """Load whole (unsharded) trainable tensors of the policy, named as
    :func:`coderl.train.checkpoint.trainable_state` names them (an SFT warm start's
    ``trainable.safetensors``), into the sharded root: each rank keeps its shard
    (``set_model_state_dict`` with ``full_state_dict=True``). Every rank calls it with the same
    tensors (a collective). The value head, if any, is left as it is.

    Raises:
        ValueError: as :func:`coderl.train.checkpoint.check_trainable` (names and full shapes).
    """
    shapes = {
        n.removeprefix("model."): p.shape  # a DTensor's shape is the global one
        for n, p in root.named_parameters()
        if p.requires_grad and n.startswith("model.")
    }
    check_trainable(shapes, tensors)
    full = {f"model.{n}": t for n, t in tensors.items()}
    # strict=False: the value head and the frozen weights are not in ``tensors``
    set_model_state_dict(root, full, options=StateDictOptions(full_state_dict=True, strict=False))


def load_sharded_checkpoint(
    path: str | Path,
    *,
    root: ShardedPolicy,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    restore_rng: bool = True,
) -> dict[str, Any]:
    """Restore what :func:`save_sharded_checkpoint` wrote, at any world size (the sharded
    weights and optimizer state through ``torch.distributed.checkpoint.load`` and
    ``set_state_dict``; scheduler, RNG and ``state.json`` on every rank); every rank calls it.

    Raises:
        FileNotFoundError: ``path`` holds no complete sharded checkpoint.
    """
    path = Path(path)
    if not (path / "state.json").is_file() or not (path / DCP_DIR).is_dir():
        raise FileNotFoundError(f"{path} is not a complete sharded checkpoint (state.json, dcp/)")
    verify_checkpoint(path)
    model_sd, optim_sd = get_state_dict(root, optimizer, options=_OPTIONS)
    loaded = {"model": model_sd, "optim": optim_sd}
    dcp.load(loaded, checkpoint_id=str(path / DCP_DIR))
    set_state_dict(
        root,
        optimizer,
        model_state_dict=loaded["model"],
        optim_state_dict=loaded["optim"],
        # frozen weights are not in the checkpoint (they come from the model's source); every
        # trainable key is, or dcp.load above raised
        options=StateDictOptions(strict=False, **_FROZEN),
    )
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=False))
    if restore_rng:
        set_rng_state(torch.load(path / "rng.pt", weights_only=False))
    out: dict[str, Any] = json.loads((path / "state.json").read_text())
    return out
