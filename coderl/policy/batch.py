"""Segments -> padded training tensors (their per-token logprobs: :mod:`coderl.policy.forward`).

Everything in a :class:`TrainBatch` is aligned to *tokens*: column ``t`` describes token
``input_ids[:, t]``; its logprob is predicted from the logits at ``t - 1``. The trainer therefore
never shifts anything: ``logprobs``, ``loss_mask`` and ``behavior_logprobs`` line up.

Padding never changes results: padded positions are masked out of attention, position ids are
explicit (a left-padded row still starts at position 0), and the loss mask comes from the
segment, never from comparing ids with the pad id (a model whose pad id equals its EOS id keeps
its sampled EOS in the loss).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from coderl.trajectory import Segment

PAD_SIDES = ("right", "left")


@dataclass
class TrainBatch:
    """Padded tensors for ``B`` segments of up to ``T`` tokens.

    Fields (all ``[B, T]``):
    - ``input_ids``: int64 token ids; padding holds the pad id.
    - ``attention_mask``: int64, 1 on real tokens, 0 on padding.
    - ``position_ids``: int64, ``0 .. len - 1`` over each row's real tokens (0 on padding).
    - ``loss_mask``: float32, 1 on sampled (trainable) tokens only.
    - ``behavior_logprobs``: float32 logprobs recorded by the sampler; 0 where not trainable.
    - ``policy_versions``: int64 weight version per sampled token; -1 where not trainable.
    """

    input_ids: Tensor
    attention_mask: Tensor
    position_ids: Tensor
    loss_mask: Tensor
    behavior_logprobs: Tensor
    policy_versions: Tensor

    def to(self, device: torch.device | str) -> TrainBatch:
        """The same batch with every tensor on ``device``."""
        return TrainBatch(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})

    @property
    def num_trainable(self) -> int:
        return int(self.loss_mask.sum())


def collate(
    segments: Sequence[Segment], pad_id: int, *, pad_side: str = "right", pad_to: int | None = None
) -> TrainBatch:
    """Pad segments into a :class:`TrainBatch`.

    Args:
        segments: validated segments (see :meth:`Segment.validate`); each needs >= 1 token.
        pad_id: the id written into padding (may equal the EOS id: masks do not depend on it).
        pad_side: ``"right"`` (default for training) or ``"left"``.
        pad_to: pad to this length instead of the longest segment (>= the longest).

    Returns:
        A :class:`TrainBatch` of shape ``[len(segments), max(len, pad_to)]``.

    Raises:
        ValueError: no segments, an empty or invalid segment, an unknown ``pad_side`` (lists
            the valid ones) or ``pad_to`` shorter than a segment.
    """
    if pad_side not in PAD_SIDES:
        raise ValueError(f"unknown pad_side {pad_side!r}; valid: {list(PAD_SIDES)}")
    if not segments:
        raise ValueError("collate needs at least one segment")
    for i, seg in enumerate(segments):
        if len(seg) == 0:
            raise ValueError(f"segment {i} is empty")
        seg.validate()
    T = max(len(s) for s in segments)
    if pad_to is not None:
        if pad_to < T:
            raise ValueError(f"pad_to={pad_to} is shorter than the longest segment ({T})")
        T = pad_to
    B = len(segments)
    out = TrainBatch(
        input_ids=torch.full((B, T), pad_id, dtype=torch.long),
        attention_mask=torch.zeros(B, T, dtype=torch.long),
        position_ids=torch.zeros(B, T, dtype=torch.long),
        loss_mask=torch.zeros(B, T, dtype=torch.float32),
        behavior_logprobs=torch.zeros(B, T, dtype=torch.float32),
        policy_versions=torch.full((B, T), -1, dtype=torch.long),
    )
    for b, seg in enumerate(segments):
        n = len(seg)
        cols = slice(0, n) if pad_side == "right" else slice(T - n, T)
        out.input_ids[b, cols] = torch.tensor(seg.token_ids, dtype=torch.long)
        out.attention_mask[b, cols] = 1
        out.position_ids[b, cols] = torch.arange(n)
        out.loss_mask[b, cols] = torch.tensor(seg.loss_mask, dtype=torch.float32)
        out.behavior_logprobs[b, cols] = torch.tensor(seg.behavior_logprobs, dtype=torch.float32)
        out.policy_versions[b, cols] = torch.tensor(seg.policy_versions, dtype=torch.long)
    return out
