"""Sequence packing for the trainer forward: a micro-batch's rows as one sequence, no padding.

``B`` padded rows of a :class:`coderl.policy.batch.TrainBatch` become one row of ``N`` tokens
(``N`` = the rows' real tokens, minus ``(B - 1) * S`` when the rows share an ``S``-token prefix
that is packed once): the position ids of every row restart at 0 (each row keeps its own rotary
positions), attention never crosses rows, and :attr:`Packed.index` maps every ``[B, T]`` token
back to its packed position, so the loss and everything downstream of the forward keep the
``[B, T]`` layout. Padding costs no FLOPs; the per-token numbers are those of the padded forward
up to float summation order.

Attention stays inside rows in one of two ways:

- no shared prefix: nothing but the restarting position ids; transformers derives the
  block-diagonal causal mask from them (``masking_utils.find_packed_sequence_indices``: a new
  sequence wherever the position does not grow by one) for SDPA and eager attention, and
  flash-attention runs its variable-length kernel from them;
- a shared prefix: an explicit ``[1, 1, N, N]`` boolean mask (:func:`prefix_block_causal_mask`),
  each row attending to the prefix and causally to its own tokens.

Limits: SDPA on CPU computes the scores of the whole ``N x N`` mask (it does not skip masked
blocks), so attention costs ``N^2`` instead of the rows' ``sum n_i^2``; the token budget of a
micro-batch bounds it. Flash-attention (GPU) takes no explicit mask, so a shared prefix is not
packed once there (see :func:`coderl.policy.forward.forward`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from coderl.policy.batch import TrainBatch

PREFIX = -1
""":attr:`Packed.row` of the shared prefix's tokens (they belong to every row)."""


@dataclass
class Packed:
    """One packed sequence of ``N`` tokens and the way back to the ``[B, T]`` layout."""

    input_ids: Tensor
    """``[1, N]`` int64 token ids: the shared prefix once, then each row's own tokens in order."""
    position_ids: Tensor
    """``[1, N]`` int64 position of each token in its own row (0 at every row's start)."""
    row: Tensor
    """``[N]`` int64 the row each token belongs to; :data:`PREFIX` for the shared prefix."""
    index: Tensor
    """``[B, T]`` int64 packed position of token ``(b, t)``; -1 on padding."""


def pack(tokens: TrainBatch, shared: int = 0) -> Packed:
    """Pack the real tokens of ``tokens`` (any padding side) into one sequence.

    Args:
        tokens: ``[B, T]`` collated batch; each row's position ids are ``0 .. len - 1``.
        shared: ``S``, the length of a prefix that every row holds at columns ``0 .. S - 1``
            (right padding), packed once; 0 for none.

    Raises:
        ValueError: ``shared`` is negative or not a prefix every row holds with at least one
            token of its own after it.
    """
    real = tokens.attention_mask > 0  # (B, T)
    B, T = real.shape
    if shared < 0:
        raise ValueError(f"shared prefix length must be >= 0, got {shared}")
    if shared:
        ids = tokens.input_ids[:, :shared]
        if not bool(real[:, : shared + 1].all() and (ids == ids[:1]).all()):
            raise ValueError(f"the rows do not share their first {shared} tokens")
    own = real.clone()
    own[:, :shared] = False  # (B, T) tokens packed per row
    rows = torch.arange(B, device=real.device)[:, None].expand(B, T)
    n_own = int(own.sum())
    index = torch.full((B, T), -1, dtype=torch.long, device=real.device)
    index[own] = torch.arange(shared, shared + n_own, device=real.device)
    index[:, :shared] = torch.arange(shared, device=real.device)
    prefix_row = torch.full((shared,), PREFIX, dtype=torch.long, device=real.device)
    return Packed(
        input_ids=torch.cat([tokens.input_ids[0, :shared], tokens.input_ids[own]])[None],
        position_ids=torch.cat([tokens.position_ids[0, :shared], tokens.position_ids[own]])[None],
        row=torch.cat([prefix_row, rows[own]]),
        index=index,
    )


def prefix_block_causal_mask(packed: Packed) -> Tensor:
    """``[1, 1, N, N]`` bool, True where packed token ``q`` attends to token ``k``: ``k <= q``
    and ``k`` is in ``q``'s row or in the shared prefix. The prefix precedes every row in the
    packed order, so causality inside the prefix and from a row into it is the same ``k <= q``."""
    row = packed.row  # (N,)
    N = row.shape[0]
    causal = torch.ones(N, N, dtype=torch.bool, device=row.device).tril()
    visible = (row[None, :] == row[:, None]) | (row[None, :] == PREFIX)  # (q, k)
    return (causal & visible)[None, None]


def unpack(hidden: Tensor, packed: Packed) -> Tensor:
    """``[1, N, H]`` packed hidden states -> ``[B, T, H]`` (zeros on padding); the gradient of
    a prefix token sums over the rows that read it."""
    index = packed.index  # (B, T)
    out = hidden[0][index.clamp(min=0)]  # (B, T, H)
    return out * (index >= 0)[..., None].to(out.dtype)


def row_lengths(tokens: TrainBatch) -> list[int]:
    """Real tokens per row (``[B]`` of the attention mask's row sums)."""
    return [int(n) for n in tokens.attention_mask.sum(-1)]
