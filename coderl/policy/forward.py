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

from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import Tensor, nn

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


def forward(
    model: nn.Module,
    tokens: TrainBatch,
    *,
    temperature: float,
    at: Tensor | None = None,
    value_head: nn.Module | None = None,
    bf16: bool = False,
    entropy_grad: bool = False,
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
        bf16: bf16 autocast of the model forward (CPU autocast).
        entropy_grad: let gradients flow through ``entropy`` (for an entropy bonus).

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
    device_type = tokens.input_ids.device.type  # autocast of the device the batch is on
    ctx = torch.autocast(device_type, dtype=torch.bfloat16) if bf16 else nullcontext()
    scored = score[:, 1:] > 0  # (B, T-1): token t+1 is scored, predicted at t
    with ctx:
        last, pred = _scored_logits(model, tokens, scored, value_head is not None)
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
    return ForwardOut(logp=logp, entropy=entropy, values=values)


def _scored_logits(
    model: nn.Module, tokens: TrainBatch, scored: Tensor, want_hidden: bool
) -> tuple[Tensor | None, Tensor]:
    """(last hidden state ``[B, T, H]`` or None, logits ``[N, V]`` at the positions that predict
    the ``N`` scored tokens). For the Llama-layout models of
    :data:`coderl.policy.kvcache.STATIC_MODEL_TYPES` (logits = ``lm_head(hidden)``, nothing
    after it) the LM head runs on those N positions only, not on all B*T: prompt and observation
    tokens cost no ``[T, V]`` logits forward or backward. Other models go through their own
    forward."""
    lm = causal_lm(model)
    args = {
        "input_ids": tokens.input_ids,
        "attention_mask": tokens.attention_mask,
        "position_ids": tokens.position_ids,
        "use_cache": False,
    }
    if lm.config.model_type in STATIC_MODEL_TYPES:
        S = 0 if want_hidden else _shared_context(tokens, scored)
        if S:
            hidden = _shared_prefix_forward(lm.model, tokens, S)  # (B, T - S, H)
            scored = scored[:, S:]
        else:
            hidden = lm.model(**args).last_hidden_state  # (B, T, H), after the final norm
        # row by row: a row's numbers then do not depend on which rows share its micro-batch
        rows = [lm.lm_head(hidden[b, :-1][scored[b]]) for b in range(hidden.shape[0])]
        return (hidden if want_hidden else None), torch.cat(rows)
    out = model(**args, output_hidden_states=want_hidden)
    return (out.hidden_states[-1] if want_hidden else None), out.logits[:, :-1][scored]


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
