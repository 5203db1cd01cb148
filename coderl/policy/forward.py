"""The one trainer forward: tempered logprobs and entropies at the scored positions of a batch.

Every trainer-side number about tokens comes from :func:`forward`: the loss (and the pre-update
``old`` logprobs) in :mod:`coderl.train.step`, the reference logprobs
(:meth:`coderl.policy.local.LocalPolicy.reference_logprobs`), the SFT loss, PPO's value
estimates, and the sampler/trainer gap (:meth:`coderl.policy.local.LocalPolicy.logprob_gap`,
reduced by :func:`coderl.algorithms.logprob_gap`). It computes logits only where a token is
scored (by default the sampled tokens, ``loss_mask == 1``): a ``[N, V]`` softmax instead of
``[B, T, V]``, so prompt and observation tokens, most of an agent's context, cost no logits.
Logprobs come from :func:`coderl.algorithms.token_logprobs` and entropies from
:func:`coderl.algorithms.entropy`, so the temperature is applied exactly as the sampler does.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

import coderl.policy.packing as packing
from coderl import algorithms as A
from coderl.policy.batch import TrainBatch
from coderl.policy.kvcache import STATIC_MODEL_TYPES, causal_lm


@dataclass
class ForwardOut:
    logp: Tensor
    """``[B, T]`` float32 logprob of token t given tokens < t; 0 where t is not scored."""
    entropy: Tensor
    """``[B, T]`` float32 entropy (nats) of the tempered distribution that predicts token t; 0
    where t is not scored."""
    values: Tensor | None = None
    """``[B, T]`` value of the state before token t (PPO), else None."""
    positions: int = 0
    """Token positions the decoder ran (padding included when unpacked; a shared prefix once),
    for FLOP counts (``bench/demo_profile.py``); 0 when not counted (a sharded forward)."""
    attended: int = 0
    """Causal query-key pairs the attention computed over those positions (per head and
    layer; a shared prefix's once); 0 when not counted."""


def forward(
    model: nn.Module,
    tokens: TrainBatch,
    *,
    temperature: float,
    at: Tensor | None = None,
    value_head: nn.Module | None = None,
    bf16: bool = False,
    entropy_grad: bool = False,
    pack: bool = False,
    checkpoint: bool = False,
    share_prefix: bool = True,
) -> ForwardOut:
    """Per-token logprobs (tempered, as sampled), entropies and values of a causal LM.

    ``logp[b, t] = log softmax(logits[b, t - 1] / temperature)[input_ids[b, t]]`` and
    ``entropy[b, t]`` the entropy of that softmax, at every scored position t, 0 elsewhere.
    ``model`` is any Hugging Face causal LM (peft-wrapped or not; with peft's
    ``disable_adapter()`` active it is the base model, the LoRA reference). The value head reads
    the last hidden state at t - 1 with gradients stopped (a linear probe on the policy's
    features), so the value loss never moves the policy.

    Args:
        model: the causal LM, on the device of ``tokens``.
        tokens: a collated batch (:func:`coderl.policy.batch.collate`), ``[B, T]`` tensors.
        temperature: the sampling temperature (> 0; use 1.0 for greedy rollouts).
        at: ``[B, T]`` bool or 0/1, the tokens to score; default ``tokens.loss_mask`` (the
            sampled ones). A row's first token (``position_ids == 0``) has no prefix and must
            not be scored.
        value_head: PPO's value head, or None (``values`` is then None).
        bf16: bf16 matmuls in the decoder's MLPs (autocast; fp32 weights, their gradients
            fp32); the attention blocks, the LM head, the log-softmax and everything after it
            stay fp32 (see docs/training.md for where autocast's gradient error came from).
            Models outside ``STATIC_MODEL_TYPES``: plain autocast of their whole forward.
        entropy_grad: let gradients flow through ``entropy`` (for an entropy bonus).
        pack: run the rows as one packed sequence without padding
            (:mod:`coderl.policy.packing`); the same numbers up to float summation order.
        checkpoint: activation checkpointing of every decoder layer (transformers'
            ``activation_checkpointing_enable``, non-reentrant ``torch.utils.checkpoint``): the
            layers' activations are recomputed in the backward instead of kept; the same
            gradient. Unpacked, it turns off the shared-prefix KV path (a cache written inside a
            recomputed layer would be written twice); packed, the prefix is still run once.
        share_prefix: allow the unpacked shared-prefix path (two decoder calls per forward);
            False runs every unpacked forward as one decoder call, which a sharded trainer
            needs (each call of a sharded layer is a collective that every rank must make).

    Returns:
        :class:`ForwardOut`; ``logp`` is differentiable when grad is enabled.

    Raises:
        ValueError: non-positive temperature, ``at`` of another shape, or a scored token
            without a prefix.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    score = tokens.loss_mask if at is None else at
    if score.shape != tokens.input_ids.shape:
        raise ValueError(f"at {tuple(score.shape)} does not match {tuple(tokens.input_ids.shape)}")
    if bool(((score > 0) & (tokens.position_ids == 0)).any()):
        raise ValueError("a scored token has no prefix (position 0): nothing predicts it")
    scored = score[:, 1:] > 0  # (B, T-1): token t+1 is scored, predicted at t
    with _checkpointed(causal_lm(model), checkpoint):
        last, pred, work = _scored_logits(
            model,
            tokens,
            scored,
            value_head is not None,
            bf16=bf16,
            pack=pack,
            share=pack or (share_prefix and not checkpoint),
        )
    pred = pred.float()  # (N, V) logits that predicted the scored tokens
    picked = A.token_logprobs(pred, tokens.input_ids[:, 1:][scored], temperature=temperature)
    logp = pred.new_zeros(tokens.input_ids.shape)  # (B, T)
    logp[:, 1:][scored] = picked
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = torch.zeros_like(logp)
        entropy[:, 1:][scored] = A.entropy(pred / temperature)  # (N,)
    values = None
    if value_head is not None:
        assert last is not None
        h = last[:, :-1].detach().float()  # (B, T-1, H)
        v = value_head(h).squeeze(-1)  # (B, T-1)
        values = torch.cat([torch.zeros_like(v[:, :1]), v], dim=1)  # (B, T)
    return ForwardOut(logp, entropy, values, *work)


def _scored_logits(
    model: nn.Module,
    tokens: TrainBatch,
    scored: Tensor,
    want_hidden: bool,
    *,
    bf16: bool,
    pack: bool,
    share: bool,
) -> tuple[Tensor | None, Tensor, tuple[int, int]]:
    """(last hidden state ``[B, T, H]`` or None, logits ``[N, V]`` at the positions that predict
    the ``N`` scored tokens, :func:`work` of the path taken). For the Llama-layout models of
    :data:`coderl.policy.kvcache.STATIC_MODEL_TYPES` (logits = ``lm_head(hidden)``, nothing
    after it) the LM head runs on those N positions only, not on all B*T: prompt and observation
    tokens cost no ``[T, V]`` logits forward or backward; under ``bf16`` it runs in fp32 on the
    fp32 hidden states. Other models go through their own forward (their logits as computed
    under autocast, then cast to fp32)."""
    lm = causal_lm(model)
    autocast = _autocast(tokens.input_ids.device.type, bf16)
    if lm.config.model_type not in STATIC_MODEL_TYPES:
        with autocast:
            return (*_own_forward(model, tokens, scored, want_hidden, pack), work(tokens, 0, pack))
    flash = "flash" in str(lm.config._attn_implementation)  # takes no explicit mask
    S = _shared_context(tokens, scored) if share and not flash else 0
    if bf16:
        _fp32_attention(lm)
    ran = work(tokens, S if pack or not want_hidden else 0, pack)
    with autocast:
        if pack:
            hidden = _packed_forward(lm.model, tokens, S)  # (B, T, H)
        elif S and not want_hidden:
            hidden = _shared_prefix_forward(lm.model, tokens, S)  # (B, T - S, H)
            scored = scored[:, S:]
        else:
            hidden = lm.model(**_plain_args(tokens)).last_hidden_state  # (B, T, H), final norm
    hidden = hidden.float()
    # row by row: a row's numbers then do not depend on which rows share its micro-batch
    rows = [lm.lm_head(hidden[b, :-1][scored[b]]) for b in range(hidden.shape[0])]
    return (hidden if want_hidden else None), torch.cat(rows), ran


def work(tokens: TrainBatch, shared: int, packed: bool) -> tuple[int, int]:
    """(token positions run, causal query-key pairs per head and layer) of a decoder forward
    over ``tokens`` (``[B, T]``) whose rows share their first ``shared`` tokens, run once.
    Packed: each row's ``L`` real tokens, ``L (L + 1) / 2`` pairs. Unpacked: the prefix once,
    then ``T - shared`` positions per row, padding included (it is computed). Model work, not
    the kernels' (a packed shared prefix runs one masked ``N x N`` attention)."""
    B, T = tokens.input_ids.shape
    S = shared
    if not packed:
        return S + B * (T - S), _pairs(S) + B * (_pairs(T) - _pairs(S))
    lengths = tokens.attention_mask.sum(-1)  # (B,)
    return int(lengths.sum()) - (B - 1) * S, int(_pairs(lengths).sum()) - (B - 1) * _pairs(S)


def _pairs(n: Any) -> Any:
    """Causal query-key pairs of ``n`` positions, ``n (n + 1) / 2`` (an int or a tensor)."""
    return n * (n + 1) // 2


def _autocast(device_type: str, bf16: bool) -> torch.autocast | nullcontext[None]:
    return torch.autocast(device_type, dtype=torch.bfloat16) if bf16 else nullcontext()


def _plain_args(tokens: TrainBatch) -> dict[str, Tensor | bool]:
    return {
        "input_ids": tokens.input_ids,
        "attention_mask": tokens.attention_mask,
        "position_ids": tokens.position_ids,
        "use_cache": False,
    }


def _own_forward(
    model: nn.Module, tokens: TrainBatch, scored: Tensor, want_hidden: bool, pack: bool
) -> tuple[Tensor | None, Tensor]:
    """:func:`_scored_logits` through the model's own forward (any causal LM); packed, the
    model finds the rows from the restarting position ids (transformers' packed path)."""
    if not pack:
        out = model(**_plain_args(tokens), output_hidden_states=want_hidden)
        return (out.hidden_states[-1] if want_hidden else None), out.logits[:, :-1][scored]
    p = packing.pack(tokens)
    out = model(
        input_ids=p.input_ids,
        position_ids=p.position_ids,
        use_cache=False,
        output_hidden_states=want_hidden,
    )
    logits = packing.unpack(out.logits, p)  # (B, T, V)
    hidden = packing.unpack(out.hidden_states[-1], p) if want_hidden else None
    return hidden, logits[:, :-1][scored]


def _packed_forward(decoder: nn.Module, tokens: TrainBatch, S: int) -> Tensor:
    """Last hidden states ``[B, T, H]`` (zeros on padding) of the rows run as one packed
    sequence (:mod:`coderl.policy.packing`), the shared first ``S`` tokens once."""
    p = packing.pack(tokens, S)
    mask = packing.prefix_block_causal_mask(p) if S else None  # None: from the position ids
    out = decoder(
        input_ids=p.input_ids, attention_mask=mask, position_ids=p.position_ids, use_cache=False
    )
    return packing.unpack(out.last_hidden_state, p)


def _fp32_attention(lm: nn.Module) -> None:
    """Make every decoder layer's self-attention (its projections and its softmax) run in fp32
    under autocast, once per model: under bf16 only the MLPs multiply in bf16.

    The switch is a pair of forward hooks keyed on the autocast state at call time, not on a
    flag of this call, so a checkpointed layer's recompute in the backward (which restores the
    forward's autocast state) computes what the forward did; a model copy (a bf16 sampler's)
    carries the hooks, and they do nothing without autocast. Measured on SmolLM2-135M: bf16 in
    the attention block is most of autocast's gradient error (docs/training.md)."""
    if getattr(lm, "_coderl_fp32_attention", False):
        return
    for layer in lm.model.layers:
        layer.self_attn.register_forward_pre_hook(_autocast_off, with_kwargs=True)
        layer.self_attn.register_forward_hook(_autocast_back, always_call=True)
    lm._coderl_fp32_attention = True


def _autocast_off(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    device = next(module.parameters()).device.type
    stack = module.__dict__.setdefault("_coderl_autocast", [])
    if not torch.is_autocast_enabled(device):
        stack.append(None)
        return args, kwargs
    ctx = torch.autocast(device, enabled=False)
    ctx.__enter__()
    stack.append(ctx)

    def fp32(x: object) -> object:
        if isinstance(x, Tensor) and x.is_floating_point():
            return x.float()
        if isinstance(x, tuple):  # (cos, sin) position embeddings
            return tuple(fp32(v) for v in x)
        return x

    return tuple(fp32(a) for a in args), {k: fp32(v) for k, v in kwargs.items()}


def _autocast_back(module: nn.Module, args: tuple, output: object) -> None:
    ctx = module.__dict__["_coderl_autocast"].pop()
    if ctx is not None:
        ctx.__exit__(None, None, None)


@contextmanager
def _checkpointed(lm: nn.Module, on: bool) -> Iterator[None]:
    """Activation checkpointing of ``lm``'s decoder layers while the block runs.

    transformers checkpoints a ``GradientCheckpointingLayer`` only when its own ``training``
    flag is set; coderl's models stay in eval mode, so the block sets that flag on the layers
    alone (their attention and MLP submodules stay in eval mode: no dropout) and restores it.

    Raises:
        ValueError: the model does not support activation checkpointing.
    """
    if not on:
        yield
        return
    from transformers.modeling_layers import GradientCheckpointingLayer

    name = "is_activation_checkpointing"  # transformers 5.24; is_gradient_checkpointing before
    if not getattr(lm, name if hasattr(type(lm), name) else "is_gradient_checkpointing", False):
        if not getattr(lm, "supports_gradient_checkpointing", False):
            raise ValueError(f"{type(lm).__name__} does not support activation checkpointing")
        lm.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    layers = [m for m in lm.modules() if isinstance(m, GradientCheckpointingLayer)]
    before = [m.training for m in layers]
    for m in layers:
        m.training = True
    try:
        yield
    finally:
        for m, flag in zip(layers, before, strict=True):
            m.training = flag


MIN_SHARED_CONTEXT = 16
"""Rows of a micro-batch whose first tokens agree on at least this many context tokens (an agent's
system prompt and tool definitions) run them through the model once."""


def _shared_context(tokens: TrainBatch, scored: Tensor) -> int:
    """Length S of the token prefix that every row of the batch shares, starting at position 0
    (right padding), such that tokens 0..S are all unscored (no scored token is predicted from
    inside the prefix; ``scored`` is ``[B, T-1]``, column t for token t+1); 0 when below
    ``MIN_SHARED_CONTEXT`` or for a single row. Every row keeps at least two tokens of its own."""
    ids, B = tokens.input_ids, tokens.input_ids.shape[0]
    if B < 2 or bool((tokens.position_ids[:, 0] != 0).any()):
        return 0
    unscored = torch.ones_like(ids, dtype=torch.bool)  # (B, T) token t is not scored
    unscored[:, 1:] = ~scored
    same = (ids == ids[:1]).all(0) & unscored.all(0) & (tokens.attention_mask > 0).all(0)
    # minus one: token S must be unscored too, its logits come from position S - 1
    S = int(same.long().cumprod(0).sum()) - 1
    S = min(S, int(tokens.attention_mask.sum(-1).min()) - 2)
    return S if S >= MIN_SHARED_CONTEXT else 0


def _shared_prefix_forward(decoder: nn.Module, tokens: TrainBatch, S: int) -> Tensor:
    """Last hidden states ``[B, T - S, H]`` of positions S.. of every row, with the shared first
    ``S`` tokens run once (batch 1) and their keys and values broadcast to the B rows. The same
    function of the weights as the plain forward (gradients flow through the broadcast and sum
    over rows), at ``(B - 1) * S`` fewer token positions; only float summation order differs."""
    from transformers import DynamicCache

    B = tokens.input_ids.shape[0]
    cache = DynamicCache()
    decoder(
        input_ids=tokens.input_ids[:1, :S],
        position_ids=tokens.position_ids[:1, :S],
        cache=cache,
        use_cache=True,
    )
    for layer in cache.layers:
        layer.keys = layer.keys.expand(B, -1, -1, -1)
        layer.values = layer.values.expand(B, -1, -1, -1)
    out = decoder(
        input_ids=tokens.input_ids[:, S:],
        attention_mask=tokens.attention_mask,
        position_ids=tokens.position_ids[:, S:],
        cache=cache,
        use_cache=True,
    )
    return out.last_hidden_state
