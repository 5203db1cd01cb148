"""Sampler precision: detect bf16 hardware, and a bf16 copy of the policy to sample from while the
trainer stays in fp32 (asymmetric precision).

``auto`` means bf16 exactly where the hardware has bf16 matrix units: on CPU the ``avx512_bf16``
or ``amx_bf16`` flags (Intel Cooper Lake / Sapphire Rapids and later, AMD Zen 4 and later), on
CUDA ``torch.cuda.is_bf16_supported()``. A CPU without them (AVX2 only, e.g. most CI runners) runs
bf16 matmuls by emulation, slower than fp32, so ``auto`` keeps fp32 there; ``bfloat16`` can still
be asked for explicitly (tests do, on any CPU).

:class:`LowPrecisionSampler` keeps a copy of the policy in bf16 for sampling. Before every
sampling call it copies the trainer's trainable parameters into the copy when any of them changed
in place since the last call (tensor version counters: an optimizer step, ``load_state_dict`` or
``copy_`` all bump them), so rollouts always use the current weights without the caller having to
sync. With LoRA that copies the adapter only (~1% of the weights).

The sampler's logprobs then come from the bf16 function while the trainer recomputes them in
fp32: the behaviour logprobs recorded on the trajectory differ from the trainer's (measured
SmolLM2-135M: mean |gap| ~2e-2 nats, see docs/benchmarks.md), and the importance weights
(``algorithm.importance``, ``old_logp=trainer``) correct exactly that difference, as in the
asymmetric-precision recipes (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
Off-Policy RL Training": truncated importance sampling against the sampler's probabilities).

Limits: frozen parameters are copied once, at construction; a change to them afterwards (there is
none in coderl: LoRA bases and references are frozen) is not seen. ``disable_adapter()`` on the
trainer's model does not reach the copy.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

PRECISIONS = ("auto", "float32", "bfloat16")
"""Valid sampler precision settings."""

BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
"""``/proc/cpuinfo`` flags of CPU instructions that compute bf16 dot products natively."""


def bf16_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> list[str]:
    """The flags of :data:`BF16_CPU_FLAGS` this CPU reports (empty when none, or no cpuinfo)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return []
    flags: set[str] = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags.update(line.partition(":")[2].split())
            break  # every core reports the same flags
    return [f for f in BF16_CPU_FLAGS if f in flags]


def has_bf16_units(device: str | torch.device = "cpu") -> bool:
    """Whether ``device`` multiplies bf16 matrices in hardware (see the module docstring)."""
    device = torch.device(device)
    if device.type == "cuda":
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    if device.type == "cpu":
        return bool(bf16_flags())
    return False


def resolve_precision(precision: str, device: str | torch.device = "cpu") -> torch.dtype:
    """The sampling dtype of a ``precision`` setting on ``device``.

    Args:
        precision: ``"auto"`` (bf16 iff :func:`has_bf16_units`), ``"float32"`` or ``"bfloat16"``.

    Raises:
        ValueError: any other name (lists the valid ones).
    """
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; valid: {list(PRECISIONS)}")
    if precision == "auto":
        return torch.bfloat16 if has_bf16_units(device) else torch.float32
    return torch.float32 if precision == "float32" else torch.bfloat16


class LowPrecisionSampler:
    """A ``dtype`` copy of ``model`` kept current with its trainable parameters.

    Args:
        model: the trainer's model (peft-wrapped or not); read, never written.
        dtype: the copy's dtype (e.g. ``torch.bfloat16``).
    """

    def __init__(self, model: nn.Module, dtype: torch.dtype):
        self.source = model
        self.dtype = dtype
        self.model = copy.deepcopy(model).to(dtype).requires_grad_(False).eval()
        mine = dict(self.model.named_parameters())
        self._pairs = [(p, mine[n]) for n, p in model.named_parameters() if p.requires_grad]
        self._seen = self._versions()

    def _versions(self) -> tuple[int, ...]:
        return tuple(p._version for p, _ in self._pairs)

    @torch.no_grad()
    def refresh(self) -> bool:
        """Copy the trainable parameters into the copy if any changed; returns whether it did."""
        now = self._versions()
        if now == self._seen:
            return False
        for src, dst in self._pairs:
            dst.copy_(src)
        self._seen = now
        return True
