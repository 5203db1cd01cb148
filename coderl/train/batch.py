"""The trainer's batch: the policy's token batch plus what RL adds (advantages, reference
logprobs, PPO value targets).

Token tensors come from :func:`coderl.policy.batch.collate` (every ``[B, T]`` column describes
token ``t``: its id, whether the policy sampled it, the logprob the sampler recorded). Every
segment of an episode carries the episode's advantage; nothing is re-tokenized.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor

from coderl.policy.batch import TrainBatch, collate
from coderl.trajectory import Segment


@dataclass
class StepBatch:
    """Everything one optimizer step consumes."""

    tokens: TrainBatch
    """``[B, T]`` ids, attention mask, positions, loss mask (float 0/1), behaviour logprobs."""
    advantages: Tensor
    """``[B]`` (one per sequence) or ``[B, T]`` (per token, e.g. GAE) float32."""
    ref_logp: Tensor | None = None
    """``[B, T]`` float32 reference-policy logprobs (needed for KL in the loss)."""
    old_values: Tensor | None = None
    """``[B, T]`` float32 value predictions at rollout time (PPO)."""
    returns: Tensor | None = None
    """``[B, T]`` float32 value targets (PPO)."""

    @property
    def size(self) -> int:
        return int(self.tokens.input_ids.shape[0])

    @property
    def loss_mask(self) -> Tensor:
        """``[B, T]`` bool, True on sampled tokens."""
        return self.tokens.loss_mask > 0

    def to(self, device: torch.device | str) -> StepBatch:
        """The same batch with every tensor on ``device``."""
        extra = {
            name: (v.to(device) if v is not None else None)
            for name in ("advantages", "ref_logp", "old_values", "returns")
            for v in [getattr(self, name)]
        }
        return StepBatch(tokens=self.tokens.to(device), **extra)

    def tensors(self) -> dict[str, Tensor]:
        """Every tensor of the batch by name (``tokens.*`` and the RL fields that are set)."""
        out = {f"tokens.{f.name}": getattr(self.tokens, f.name) for f in fields(self.tokens)}
        for name in ("advantages", "ref_logp", "old_values", "returns"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out

    def rows(self, start: int, stop: int) -> StepBatch:
        """Rows ``start:stop`` with the same padded length T."""
        tok = TrainBatch(
            **{f.name: getattr(self.tokens, f.name)[start:stop] for f in fields(self.tokens)}
        )
        extra = {
            name: (v[start:stop] if v is not None else None)
            for name in ("advantages", "ref_logp", "old_values", "returns")
            for v in [getattr(self, name)]
        }
        return StepBatch(tokens=tok, **extra)


def micro_batch_spans(
    batch: StepBatch, micro_batch_size: int, max_tokens: int | None = None
) -> list[tuple[int, int]]:
    """``(start, stop)`` row ranges of the micro-batches of ``batch``, in row order.

    Without ``max_tokens``: ``micro_batch_size`` rows each. With it: consecutive rows while their
    real tokens (attention mask, not padding) add up to at most ``max_tokens``; a row longer than
    the budget gets a micro-batch of its own (a row is never split). Deterministic, so an
    update epoch's micro-batch ``i`` is the same rows as the first epoch's.

    Raises:
        ValueError: a budget below 1.
    """
    if max_tokens is None:
        size = micro_batch_size
        return [(i, min(i + size, batch.size)) for i in range(0, batch.size, size)]
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    spans: list[tuple[int, int]] = []
    start, used = 0, 0
    for row, n in enumerate(int(n) for n in batch.tokens.attention_mask.sum(-1)):
        if row > start and used + n > max_tokens:
            spans.append((start, row))
            start, used = row, 0
        used += n
    spans.append((start, batch.size))
    return spans


def build_batch(segments: list[Segment], advantages: list[float], pad_id: int) -> StepBatch:
    """Collate segments (right padding) and attach one advantage per segment.

    Raises:
        ValueError: ``len(advantages) != len(segments)``, or anything
            :func:`coderl.policy.batch.collate` rejects (empty or invalid segments).
    """
    if len(advantages) != len(segments):
        raise ValueError(f"{len(advantages)} advantages for {len(segments)} segments")
    tokens = collate(segments, pad_id)
    return StepBatch(tokens=tokens, advantages=torch.tensor(advantages, dtype=torch.float32))
