"""The algorithm-blind trainer step: token batch in, one optimizer step and metrics out.

The step receives tokens, loss masks, advantages, behaviour logprobs (and, when the config asks
for them, reference logprobs and PPO value targets). It does not know which advantage estimator
produced the advantages; loss aggregation, clipping, importance weights and KL come from the
``algorithm`` config section and :mod:`coderl.algorithms`.

Micro-batching: the batch is cut into micro-batches of ``micro_batch_size`` rows that all share
the batch's padded length; each micro-batch loss is scaled by its share of the batch's normaliser
(tokens, non-empty rows or rows, per aggregation mode), so the accumulated gradient equals the
full-batch gradient whatever the split. One optimizer step is taken per update epoch, however
many segments or turns the episodes have.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from coderl import algorithms as A
from coderl.config import AlgorithmConfig, TrainerConfig
from coderl.policy.batch import TrainBatch
from coderl.policy.kvcache import STATIC_MODEL_TYPES, causal_lm
from coderl.train.batch import StepBatch


@dataclass
class ForwardOut:
    logp: Tensor
    """``[B, T]`` float32 logprob of token t given tokens < t (0 at t = 0)."""
    entropy: Tensor
    """``[B, T]`` float32 entropy (nats) of the distribution that predicts token t."""
    values: Tensor | None = None
    """``[B, T]`` value of the state before token t (PPO), else None."""


def forward(
    model: nn.Module,
    tokens: TrainBatch,
    *,
    temperature: float,
    value_head: nn.Module | None = None,
    bf16: bool = False,
    entropy_grad: bool = False,
) -> ForwardOut:
    """Per-token logprobs (tempered, as sampled), entropies and values of a causal LM.

    ``model`` is any Hugging Face causal LM (peft-wrapped or not). Column t of ``logp`` and
    ``entropy`` describes the tempered distribution that predicted token t (the same numbers as
    :func:`coderl.policy.batch.shifted_token_logprobs` / ``shifted_entropy``), computed only where
    ``loss_mask`` is 1 and 0 elsewhere. The value head reads the last hidden
    state at t - 1 with gradients stopped (a linear probe on the policy's features), so the value
    loss never moves the policy.
    """
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else nullcontext()
    # only sampled tokens need logprobs and entropies: a [N, V] softmax instead of [B, T, V]
    sampled = tokens.loss_mask[:, 1:] > 0  # (B, T-1) token t+1 is sampled
    with ctx:
        last, pred = _sampled_logits(model, tokens, sampled, value_head is not None)
    pred = pred.float() / temperature  # (N, V) logits that predicted the sampled tokens
    logp_all = pred.log_softmax(-1)  # (N, V)
    picked = logp_all.gather(-1, tokens.input_ids[:, 1:][sampled].unsqueeze(-1)).squeeze(-1)
    logp = pred.new_zeros(tokens.input_ids.shape, dtype=torch.float32)  # (B, T)
    logp[:, 1:][sampled] = picked
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        h = -(logp_all.exp() * logp_all).sum(-1)  # (N,)
        entropy = torch.zeros_like(logp)
        entropy[:, 1:][sampled] = h
    values = None
    if value_head is not None:
        assert last is not None
        h = last[:, :-1].detach().float()  # (B, T-1, H)
        v = value_head(h).squeeze(-1)  # (B, T-1)
        values = torch.cat([torch.zeros_like(v[:, :1]), v], dim=1)  # (B, T)
    return ForwardOut(logp=logp, entropy=entropy, values=values)


def _sampled_logits(
    model: nn.Module, tokens: TrainBatch, sampled: Tensor, want_hidden: bool
) -> tuple[Tensor | None, Tensor]:
    """(last hidden state ``[B, T, H]`` or None, logits ``[N, V]`` at the positions that predict
    the ``N`` sampled tokens). For the Llama-layout models of
    :data:`coderl.policy.kvcache.STATIC_MODEL_TYPES` (logits = ``lm_head(hidden)``, nothing
    after it) the LM head runs on those N positions only, not on all B*T: prompt and observation
    tokens, most of an agent's context, cost no ``[T, V]`` logits forward or backward. Other
    models go through their own forward."""
    lm = causal_lm(model)
    args = {
        "input_ids": tokens.input_ids,
        "attention_mask": tokens.attention_mask,
        "position_ids": tokens.position_ids,
        "use_cache": False,
    }
    if lm.config.model_type in STATIC_MODEL_TYPES:
        S = 0 if want_hidden else _shared_context(tokens)
        if S:
            hidden = _shared_prefix_forward(lm.model, tokens, S)  # (B, T - S, H)
            sampled = sampled[:, S:]
        else:
            hidden = lm.model(**args).last_hidden_state  # (B, T, H), after the final norm
        # row by row: a row's numbers then do not depend on which rows share its micro-batch
        rows = [lm.lm_head(hidden[b, :-1][sampled[b]]) for b in range(hidden.shape[0])]
        return (hidden if want_hidden else None), torch.cat(rows)
    out = model(**args, output_hidden_states=want_hidden)
    return (out.hidden_states[-1] if want_hidden else None), out.logits[:, :-1][sampled]


MIN_SHARED_CONTEXT = 16
"""Rows of a micro-batch whose first tokens agree on at least this many context tokens (an agent's
system prompt and tool definitions) run them through the model once."""


def _shared_context(tokens: TrainBatch) -> int:
    """Length S of the token prefix that every row of the batch shares, starting at position 0
    (right padding), such that tokens 0..S are all context (no trainable token is predicted from
    inside the prefix); 0 when below ``MIN_SHARED_CONTEXT`` or for a single row. Every row keeps
    at least two tokens of its own."""
    ids, B = tokens.input_ids, tokens.input_ids.shape[0]
    if B < 2 or bool((tokens.position_ids[:, 0] != 0).any()):
        return 0
    same = (
        (ids == ids[:1]).all(0)
        & (tokens.loss_mask == 0).all(0)
        & (tokens.attention_mask > 0).all(0)
    )
    # minus one: token S must be context too, its logits come from position S - 1
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


def _normalisers(mask: Tensor) -> dict[str, float]:
    return {
        "tokens": float(mask.sum()),
        "nonempty": float((mask.sum(-1) > 0).sum()),
        "rows": float(mask.shape[0]),
    }


# aggregation mode -> which count normalises it; the micro-batch's share of that count scales it
_NORMALISED_BY = {
    "token-mean": "tokens",
    "seq-mean-token-mean": "nonempty",
    "seq-mean-token-sum": "rows",
    "seq-mean-token-sum-norm": "rows",
}


def _micro_batches(batch: StepBatch, size: int) -> Iterator[tuple[int, StepBatch]]:
    for i, start in enumerate(range(0, batch.size, size)):
        yield i, batch.rows(start, start + size)


# aggregated losses: their micro-batch values add up, scaled by the share, to the batch value
_LOSS_KEYS = ("loss", "pg_loss", "kl", "entropy", "value_loss")


@dataclass
class _Totals:
    """Batch metrics from micro-batch metrics: losses by share, rates by token count."""

    sums: dict[str, float] = field(default_factory=dict)
    maxes: dict[str, float] = field(default_factory=dict)
    tokens: float = 0.0

    def add(self, metrics: dict[str, float], tokens: float, share: float) -> None:
        self.tokens += tokens
        for k, v in metrics.items():
            if k.endswith("_max"):
                self.maxes[k] = max(self.maxes.get(k, float("-inf")), v)
            else:
                w = share if k in _LOSS_KEYS else tokens
                self.sums[k] = self.sums.get(k, 0.0) + v * w

    def means(self) -> dict[str, float]:
        n = max(self.tokens, 1.0)
        rates = {k: v / n for k, v in self.sums.items() if k not in _LOSS_KEYS}
        losses = {k: v for k, v in self.sums.items() if k in _LOSS_KEYS}
        return {**losses, **rates, **self.maxes}


def accumulate_gradients(
    model: nn.Module,
    batch: StepBatch,
    cfg: AlgorithmConfig,
    *,
    micro_batch_size: int,
    temperature: float,
    max_len: int,
    value_head: nn.Module | None = None,
    old_logp_cache: dict[int, Tensor] | None = None,
    bf16: bool = False,
) -> dict[str, float]:
    """Backward the loss of ``batch`` in micro-batches; gradients accumulate in ``.grad``.

    Loss per token (all reduced with ``cfg.loss_agg`` over the whole batch):
    PPO clipped surrogate (:func:`coderl.algorithms.policy_loss`) with importance weights
    ``exp(old_logp - behaviour_logp)`` when ``cfg.old_logp == "trainer"``,
    ``+ kl.coef * KL`` (:func:`coderl.algorithms.kl_penalty`, needs ``batch.ref_logp``),
    ``- entropy_coef * H``, and ``+ value_coef * value_loss`` when ``batch.returns`` is set.

    Args:
        model: the policy (a causal LM).
        batch: the full batch of this optimizer step.
        cfg: the ``algorithm`` config section.
        micro_batch_size: rows per forward/backward.
        temperature: the sampling temperature (logprobs are tempered like the sampler's).
        max_len: the generation budget, constant of ``seq-mean-token-sum-norm``.
        value_head: the PPO value head, required when ``batch.returns`` is set.
        old_logp_cache: micro-batch index -> trainer logprobs before the update; filled on the
            first epoch, read on later ones (``old_logp="trainer"``).
        bf16: bf16 autocast of the forward pass.

    Returns:
        Metrics averaged over sampled tokens: ``loss``, ``pg_loss``, ``kl``, ``entropy``,
        ``clip_frac_low``, ``clip_frac_high``, ``dual_clip_frac``, ``approx_kl``,
        ``ratio_mean``, ``ratio_max``, ``iw_mean``, ``iw_max``, ``logprob_gap`` (mean
        |trainer - sampler| logprob), ``value_loss``.

    Raises:
        ValueError: KL in the loss without ``batch.ref_logp``, or value targets without a head.
    """
    if cfg.kl.coef > 0 and batch.ref_logp is None:
        raise ValueError("algorithm.kl.coef > 0 needs reference logprobs in the batch (ref_logp)")
    if batch.returns is not None and value_head is None:
        raise ValueError("the batch holds value targets (PPO) but no value head was given")
    agg = cfg.loss_agg
    full = _normalisers(batch.loss_mask)[_NORMALISED_BY[agg]]
    totals = _Totals()
    cache = {} if old_logp_cache is None else old_logp_cache
    for i, mb in _micro_batches(batch, micro_batch_size):
        mask = mb.loss_mask
        share = _normalisers(mask)[_NORMALISED_BY[agg]] / max(full, 1.0)
        if share == 0:
            continue
        out = forward(
            model,
            mb.tokens,
            temperature=temperature,
            value_head=value_head if mb.returns is not None else None,
            bf16=bf16,
            entropy_grad=cfg.entropy_coef > 0,
        )
        if cfg.old_logp == "trainer":
            old = cache.setdefault(i, out.logp.detach())
        else:
            old = mb.tokens.behavior_logprobs
        weights = None
        if cfg.old_logp == "trainer" and cfg.importance.mode != "off":
            imp = cfg.importance
            weights = A.importance_weights(
                old,
                mb.tokens.behavior_logprobs,
                mask,
                level=imp.level,
                mode=imp.mode,
                cap=imp.cap,
                low=imp.low,
            )
        pg, m = A.policy_loss(
            out.logp,
            old,
            mb.advantages,
            mask,
            clip_low=cfg.clip_low,
            clip_high=cfg.clip_high,
            dual_clip=cfg.dual_clip,
            agg=agg,
            max_len=max_len,
            weights=weights,
        )
        loss = pg
        ent = A.aggregate(out.entropy, mask, agg, max_len=max_len)
        if cfg.entropy_coef > 0:
            loss = loss - cfg.entropy_coef * ent
        kl = torch.zeros(())
        if mb.ref_logp is not None:
            kl_tok = A.kl_penalty(out.logp, mb.ref_logp, cfg.kl.estimator)
            kl = A.aggregate(kl_tok, mask, agg, max_len=max_len)
            if cfg.kl.coef > 0:
                loss = loss + cfg.kl.coef * kl
        vloss = torch.zeros(())
        if out.values is not None:
            assert mb.old_values is not None and mb.returns is not None
            vloss = A.value_loss(
                out.values, mb.old_values, mb.returns, mask, clip=cfg.value_clip, agg=agg
            )
            loss = loss + cfg.value_coef * vloss
        (loss * share).backward()
        with torch.no_grad():
            n = float(mask.sum())
            gap = ((out.logp.detach() - mb.tokens.behavior_logprobs).abs() * mask).sum() / max(
                n, 1.0
            )
            w = weights if weights is not None else mask.float()
            m.update(
                loss=float(loss),
                pg_loss=float(pg),
                kl=float(kl),
                entropy=float(ent),
                value_loss=float(vloss),
                logprob_gap=float(gap),
                iw_mean=float((w * mask).sum() / max(n, 1.0)),
                iw_max=float(w[mask].max()) if n else 1.0,
            )
        totals.add(m, n, share)
    return totals.means()


def optimizer_step(
    params: list[nn.Parameter],
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    grad_clip: float | None,
) -> dict[str, float]:
    """Clip the global gradient norm, step optimizer and schedule, clear gradients.

    Returns:
        ``grad_norm`` (before clipping) and ``lr`` (of the first group, for this step).
    """
    lr = float(optimizer.param_groups[0]["lr"])
    max_norm = grad_clip if grad_clip is not None else float("inf")
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return {"grad_norm": float(norm), "lr": lr}


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    batch: StepBatch,
    alg: AlgorithmConfig,
    trainer: TrainerConfig,
    *,
    temperature: float,
    max_len: int,
    value_head: nn.Module | None = None,
) -> dict[str, float]:
    """``trainer.update_epochs`` optimizer steps on ``batch`` (one per epoch).

    Returns:
        The metrics of :func:`accumulate_gradients` for the first epoch (the on-policy one),
        plus ``grad_norm``, ``lr``, ``optimizer_steps`` (this call), ``sequences`` and
        ``trained_tokens``.
    """
    params = [p for g in optimizer.param_groups for p in g["params"]]
    cache: dict[int, Tensor] = {}
    metrics: dict[str, float] = {}
    for epoch in range(trainer.update_epochs):
        m = accumulate_gradients(
            model,
            batch,
            alg,
            micro_batch_size=trainer.micro_batch_size,
            temperature=temperature,
            max_len=max_len,
            value_head=value_head,
            old_logp_cache=cache,
            bf16=trainer.bf16,
        )
        m.update(optimizer_step(params, optimizer, scheduler, trainer.grad_clip))
        if epoch == 0:
            metrics = m
    metrics.update(
        optimizer_steps=float(trainer.update_epochs),
        sequences=float(batch.size),
        trained_tokens=float(batch.loss_mask.sum()),
    )
    return metrics
