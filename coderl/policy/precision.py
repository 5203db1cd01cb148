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
``copy_`` all bump them) or the policy's weight version moved (a fused optimizer's step does not
bump the counters; coderl's loop bumps the version after every step), so rollouts always use the
current weights without the caller having to sync. With LoRA the copy has the adapter merged into its weights (see
:class:`LowPrecisionSampler`).

The sampler's logprobs then come from the bf16 function while the trainer recomputes them in
fp32: the behaviour logprobs recorded on the trajectory differ from the trainer's (measured
SmolLM2-135M: mean |gap| ~2e-2 nats, see docs/benchmarks.md), and the importance weights
(``algorithm.importance``, ``old_logp=trainer``) correct exactly that difference, as in the
asymmetric-precision recipes (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
Off-Policy RL Training": truncated importance sampling against the sampler's probabilities).

Limits: frozen parameters are copied once, at construction (a LoRA base's are re-read at every
merge); a change to them afterwards (there is
none in coderl: LoRA bases and references are frozen) is not seen. ``disable_adapter()`` on the
trainer's model does not reach the copy.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from peft import PeftModel
from peft.tuners.lora import LoraLayer
from torch import nn

PRECISIONS = ("auto", "float32", "bfloat16")
"""Valid sampler precision settings."""

BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
"""``/proc/cpuinfo`` flags of CPU instructions that compute bf16 dot products natively."""


def cpu_info(cpuinfo: str | Path = "/proc/cpuinfo") -> tuple[str, set[str]]:
    """(the CPU's model name, its instruction flags) from the first core of ``cpuinfo`` (every
    core reports the same); ``("unknown", set())`` when it cannot be read."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return "unknown", set()
    model, flags = "unknown", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and model == "unknown":
            model = value.strip()
        elif key.strip() == "flags":
            flags = set(value.split())
            break
    return model, flags


def bf16_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> list[str]:
    """The flags of :data:`BF16_CPU_FLAGS` this CPU reports (empty when none, or no cpuinfo)."""
    flags = cpu_info(cpuinfo)[1]
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

    A LoRA model's copy is merged: one plain linear layer per adapted projection holding
    ``W + (alpha / r) B A`` (Hu et al. 2021, "LoRA", Sec. 4.2: no added inference latency), so
    sampling pays for no adapter matmuls (at batch 32 on this CPU they cost 100-130 us per
    projection and step, 20-27 ms per SmolLM2 decode step). On a refresh the merged weights are
    recomputed from the trainer's frozen base weights and current adapters.

    Args:
        model: the trainer's model (peft-wrapped or not); read, never written.
        dtype: the copy's dtype (e.g. ``torch.bfloat16``).
    """

    def __init__(self, model: nn.Module, dtype: torch.dtype):
        self.source = model
        self.dtype = dtype
        self._lora: list[tuple[nn.Module, nn.Linear]] = []  # (peft LoRA layer, merged linear)
        if isinstance(model, PeftModel):
            merged = copy.deepcopy(model).merge_and_unload()
            mine = dict(merged.named_modules())
            prefix = "base_model.model."
            for name, module in model.named_modules():
                if isinstance(module, LoraLayer):
                    target = mine[name.removeprefix(prefix)]
                    assert isinstance(target, nn.Linear), f"{name}: only linear LoRA layers"
                    self._lora.append((module, target))
            self.model: nn.Module = merged.to(dtype).requires_grad_(False).eval()
            self._pairs: list[tuple[nn.Parameter, nn.Parameter]] = []
        else:
            self.model = copy.deepcopy(model).to(dtype).requires_grad_(False).eval()
            mine = dict(self.model.named_parameters())
            self._pairs = [(p, mine[n]) for n, p in model.named_parameters() if p.requires_grad]
        self._watched = [p for p, _ in self._pairs] + [
            p for layer, _ in self._lora for p in layer.parameters() if p.requires_grad
        ]
        self._seen = self._versions()

    def _versions(self) -> tuple[int, ...]:
        return tuple(p._version for p in self._watched)

    @torch.no_grad()
    def refresh(self, force: bool = False) -> bool:
        """Copy (or merge) the trainable parameters into the copy if any changed in place, or
        if ``force`` (the caller knows the weights changed: fused optimizers, e.g. ``AdamW(...,
        fused=True)``, update parameters without bumping their version counters); returns
        whether it did."""
        now = self._versions()
        if now == self._seen and not force:
            return False
        for src, dst in self._pairs:
            dst.copy_(src)
        for layer, linear in self._lora:
            base = layer.get_base_layer().weight
            delta = sum(layer.get_delta_weight(a) for a in layer.active_adapters)
            linear.weight.copy_(base + delta)
        self._seen = now
        return True
