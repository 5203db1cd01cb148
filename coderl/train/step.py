"""The algorithm-blind trainer step: token batch in, one optimizer step and metrics out.

The step receives tokens, loss masks, advantages, behaviour logprobs (and, when the config asks
for them, reference logprobs and PPO value targets). It does not know which advantage estimator
produced the advantages; loss aggregation, clipping, importance weights and KL come from the
``algorithm`` config section and :mod:`coderl.algorithms`.

Micro-batching: the batch is cut into micro-batches of ``micro_batch_size`` rows that all share
the batch's padded length, or, with a token budget (``trainer.max_tokens_per_micro_batch``), into
runs of rows of at most that many real tokens, each run packed into one sequence without padding
(:mod:`coderl.policy.packing`); each micro-batch loss is scaled by its share of the batch's
normaliser (tokens, non-empty rows or rows, per aggregation mode), so the accumulated gradient
equals the full-batch gradient whatever the split or the packing. One optimizer step is taken per update epoch, however
many segments or turns the episodes have.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from coderl import algorithms as A
from coderl.config import AlgorithmConfig, TrainerConfig
from coderl.policy.forward import ForwardOut, forward
from coderl.policy.precision import has_bf16_units
from coderl.train.batch import StepBatch, micro_batch_spans

__all__ = [
    "DataParallel",
    "ForwardOut",
    "accumulate_gradients",
    "forward",
    "optimizer_step",
    "train_step",
]


@dataclass
class DataParallel:
    """How one rank's share of a data-parallel batch joins the other ranks' (the seam to
    :mod:`coderl.train.distributed`; this module stays free of ``torch.distributed``).

    Every rank must make the same sequence of sharded forwards and backwards (each is a
    collective), so a rank with fewer micro-batches than another runs ``filler`` forwards and
    zero-loss backwards until the counts agree; they add exactly zero to every gradient.
    """

    all_sum: Callable[[float], float]
    """A count summed over the ranks (the batch normaliser of the global batch)."""
    all_max: Callable[[int], int]
    """A count's maximum over the ranks (micro-batches run)."""
    forward: Callable[..., ForwardOut]
    """:func:`coderl.policy.forward.forward` with the same signature, through the sharded
    module (so its hooks gather the parameters)."""
    filler: StepBatch
    """A one-row micro-batch (any row with the batch's fields) for the padding passes."""


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


def _micro_batches(
    batch: StepBatch, size: int, max_tokens: int | None
) -> Iterator[tuple[int, StepBatch]]:
    for i, (start, stop) in enumerate(micro_batch_spans(batch, size, max_tokens)):
        yield i, batch.rows(start, stop)


# aggregated losses: their micro-batch values add up, scaled by the share, to the batch value
_LOSS_KEYS = ("loss", "pg_loss", "kl", "entropy", "value_loss")


@dataclass
class _Totals:
    """Batch metrics from micro-batch metrics: losses by share, rates by token count."""

    sums: dict[str, float] = field(default_factory=dict)
    maxes: dict[str, float] = field(default_factory=dict)
    tokens: float = 0.0
    positions: int = 0  # the forwards' work (ForwardOut.positions, .attended), summed
    attended: int = 0

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
        work = {"forward_tokens": float(self.positions), "forward_attended": float(self.attended)}
        return {**losses, **rates, **self.maxes, **work}


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
    max_tokens: int | None = None,
    checkpoint: bool = False,
    dp: DataParallel | None = None,
) -> dict[str, float]:
    """Backward the loss of ``batch`` in micro-batches; gradients accumulate in ``.grad``.

    Loss per token (all reduced with ``cfg.loss_agg`` over the whole batch):
    PPO clipped surrogate (:func:`coderl.algorithms.policy_loss`) with importance weights
    ``exp(old_logp - behaviour_logp)`` when ``cfg.old_logp == "trainer"``,
    ``+ kl.coef * k2`` (:func:`coderl.algorithms.kl_penalty` with
    :data:`coderl.algorithms.KL_LOSS_ESTIMATOR`, the estimator whose gradient is
    ``grad KL(pi || ref)``; needs ``batch.ref_logp``), ``- entropy_coef * H``, and
    ``+ value_coef * value_loss`` when ``batch.returns`` is set.

    Masked importance sampling (``cfg.importance.mode == "mask"``) rejects tokens from every
    term and from the normaliser: see :func:`_rejection_masks`.

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
        bf16: bf16 matmuls in the decoder, fp32 LM head and loss (see
            :func:`coderl.policy.forward.forward`).
        max_tokens: token budget of a micro-batch (None: ``micro_batch_size`` rows, padded);
            set, micro-batches are cut by :func:`coderl.train.batch.micro_batch_spans` and
            packed.
        checkpoint: activation checkpointing of the decoder layers.
        dp: data-parallel training (:class:`DataParallel`): ``batch`` is this rank's share of
            the global batch; every share is scaled by the *global* normaliser (the sum of the
            ranks' counts), so the sum of the ranks' gradients is the gradient of the global
            batch, and the loss metrics summed over ranks are the global batch's.

    Returns:
        Metrics averaged over the tokens in the loss: ``loss``, ``pg_loss``, ``kl`` (only when
        the batch has reference logprobs: absent, not 0, otherwise), ``entropy``,
        ``clip_frac_low``, ``clip_frac_high``, ``dual_clip_frac``, ``approx_kl``,
        ``ratio_mean``, ``ratio_max``, ``iw_mean``, ``iw_max``, ``value_loss`` (only with a
        value head);
        ``iw_rejected_frac`` (sampled tokens rejected by masked importance sampling); and over
        every sampled token, the sampler/trainer gap of :func:`coderl.algorithms.logprob_gap`
        (``logprob_gap``, ``logprob_gap_max``, ``logprob_gap_kl``) at the weights before the
        update.

    Raises:
        ValueError: KL in the loss without ``batch.ref_logp``, or value targets without a head.
    """
    if cfg.kl.coef > 0 and batch.ref_logp is None:
        raise ValueError("algorithm.kl.coef > 0 needs reference logprobs in the batch (ref_logp)")
    if batch.returns is not None and value_head is None:
        raise ValueError("the batch holds value targets (PPO) but no value head was given")
    cache = {} if old_logp_cache is None else old_logp_cache
    weighted = cfg.old_logp == "trainer" and cfg.importance.mode != "off"

    fwd = forward if dp is None else dp.forward

    def run(mb: StepBatch) -> ForwardOut:
        return fwd(
            model,
            mb.tokens,
            temperature=temperature,
            value_head=value_head if mb.returns is not None else None,
            bf16=bf16,
            entropy_grad=cfg.entropy_coef > 0,
            pack=max_tokens is not None,
            checkpoint=checkpoint,
        )

    def micro_batches() -> Iterator[tuple[int, StepBatch]]:
        return _micro_batches(batch, micro_batch_size, max_tokens)

    masks: dict[int, Tensor] = {}  # micro-batch -> loss mask with the rejected tokens removed
    if weighted and cfg.importance.mode == "mask":
        masks = _rejection_masks(micro_batches(), cfg, cache, run, dp)
    by = _NORMALISED_BY[cfg.loss_agg]
    full = sum(_normalisers(masks.get(i, mb.loss_mask))[by] for i, mb in micro_batches())
    if dp is not None:
        full = dp.all_sum(full)
        # the passes to run: every rank the same count (each pass is a sharded collective),
        # known before the first one; the real ones first, then zero-loss fillers
        real = sum(_normalisers(masks.get(i, mb.loss_mask))[by] > 0 for i, mb in micro_batches())
        fillers = dp.all_max(real) - real
    totals = _Totals()
    gap_parts: list[tuple[Tensor, Tensor]] = []  # (trainer, behaviour) logprobs of sampled tokens
    for i, mb in micro_batches():
        mask = masks.get(i, mb.loss_mask)
        sampled = mb.loss_mask > 0
        share = _normalisers(mask)[by] / max(full, 1.0)
        if share == 0:
            if i in cache:  # every token rejected: still part of the gap
                gap_parts.append((cache[i][sampled], mb.tokens.behavior_logprobs[sampled]))
            continue
        out = run(mb)
        totals.positions += out.positions
        totals.attended += out.attended
        if cfg.old_logp == "trainer":
            old = cache.setdefault(i, out.logp.detach())
        else:
            old = mb.tokens.behavior_logprobs
        weights = behaviour_importance(cfg, old, mb) if weighted else None
        m, n = _micro_batch_backward(out, mb, old, mask, weights, share, cfg, max_len)
        before = old if cfg.old_logp == "trainer" else out.logp.detach()
        gap_parts.append((before[sampled], mb.tokens.behavior_logprobs[sampled]))
        totals.add(m, n, share)
    if dp is not None:
        for _ in range(fillers):
            _zero_backward(run(dp.filler))
    return _batch_metrics(totals, batch, masks, gap_parts)


def _zero_backward(out: ForwardOut) -> None:
    """A padding pass of a sharded step: backward ``0 * (sum of its outputs)``, which reaches
    every parameter a real micro-batch reaches and adds exactly zero to each gradient."""
    loss = out.logp.sum() + (out.values.sum() if out.values is not None else 0.0)
    (loss * 0.0).backward()


def _batch_metrics(
    totals: _Totals,
    batch: StepBatch,
    masks: dict[int, Tensor],
    gap_parts: list[tuple[Tensor, Tensor]],
) -> dict[str, float]:
    """The batch's metrics from its micro-batches': the totals' means, ``iw_rejected_frac``
    and the sampler/trainer gap over every sampled token (``gap_parts``: per micro-batch, the
    trainer logprobs before the update and the behaviour logprobs)."""
    metrics = totals.means()
    sampled_total = float(batch.loss_mask.sum())
    kept_total = sum(float(mk.sum()) for mk in masks.values()) if masks else sampled_total
    metrics["iw_rejected_frac"] = 1.0 - kept_total / sampled_total if sampled_total else 0.0
    if gap_parts:
        train_lp, behaviour_lp = (torch.cat(x) for x in zip(*gap_parts, strict=True))
        metrics.update(A.logprob_gap(train_lp, behaviour_lp, torch.ones_like(train_lp)))
    return metrics


@torch.no_grad()
def _rejection_masks(
    micro_batches: Iterator[tuple[int, StepBatch]],
    cfg: AlgorithmConfig,
    cache: dict[int, Tensor],
    run: Callable[[StepBatch], ForwardOut],
    dp: DataParallel | None = None,
) -> dict[int, Tensor]:
    """Masked importance sampling: micro-batch -> its loss mask without the rejected tokens.

    Tokens whose weight falls outside the band are rejected, i.e. removed from the mask of every
    term *and* from the normaliser (Liu et al. 2025, "When Speed Kills Stability", MIS; verl's
    rollout correction does the same through its response mask), so the loss of the kept tokens
    does not shrink with the number rejected. The rejections must be known before the first
    backward (they set the batch normaliser), so on the first epoch a no-grad forward fills
    ``cache`` (the trainer logprobs before the update) first; this costs one extra forward in
    mask mode only. Sharded (``dp``), the ranks' forward counts are padded to agree."""
    masks = {}
    mbs = list(micro_batches)
    fillers = 0
    if dp is not None:  # the same forward count on every rank, known before the first one
        forwards = sum(i not in cache for i, _ in mbs)
        fillers = dp.all_max(forwards) - forwards
    for i, mb in mbs:
        if i not in cache:
            cache[i] = run(mb).logp
        w = behaviour_importance(cfg, cache[i], mb)
        masks[i] = mb.loss_mask * (w > 0)
    for _ in range(fillers):
        run(dp.filler)  # type: ignore[union-attr]
    return masks


def _micro_batch_backward(
    out: ForwardOut,
    mb: StepBatch,
    old: Tensor,
    mask: Tensor,
    weights: Tensor | None,
    share: float,
    cfg: AlgorithmConfig,
    max_len: int,
) -> tuple[dict[str, float], float]:
    """Backward one micro-batch's loss scaled by its ``share`` of the batch normaliser (see
    :func:`accumulate_gradients`); returns its metrics and its count of tokens in the loss.

    Args:
        out: the micro-batch's forward; old: ``[b, T]`` logprobs the ratio is taken against;
        mask: ``[b, T]`` loss mask (rejected tokens removed); weights: ``[b, T]`` importance
        weights or None.
    """
    agg = cfg.loss_agg
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
    kl = None  # measured only against reference logprobs (algorithm.kl.coef > 0): else absent
    if mb.ref_logp is not None:
        kl_tok = A.kl_penalty(out.logp, mb.ref_logp, cfg.kl.estimator)
        kl = A.aggregate(kl_tok, mask, agg, max_len=max_len)
        if cfg.kl.coef > 0:
            loss = loss + cfg.kl.coef * kl
    vloss = None  # a value head's loss (gae): absent without one, not 0
    if out.values is not None:
        assert mb.old_values is not None and mb.returns is not None
        vloss = A.value_loss(
            out.values, mb.old_values, mb.returns, mask, clip=cfg.value_clip, agg=agg
        )
        loss = loss + cfg.value_coef * vloss
    (loss * share).backward()
    with torch.no_grad():
        keep = mask > 0
        n = float(keep.sum())
        w = weights if weights is not None else mask.float()
        m.update(
            loss=float(loss),
            pg_loss=float(pg),
            entropy=float(ent),
            iw_mean=float((w * mask).sum() / max(n, 1.0)),
            iw_max=float(w[keep].max()) if n else 1.0,
        )
        if kl is not None:
            m["kl"] = float(kl)
        if vloss is not None:
            m["value_loss"] = float(vloss)
    return m, n


def behaviour_importance(cfg: AlgorithmConfig, old: Tensor, mb: StepBatch) -> Tensor:
    """``[B, T]`` weights ``old / behaviour`` of a (micro-)batch per ``cfg.importance``
    (:func:`coderl.algorithms.importance_weights`): the one call of every trainer, the online
    update's included."""
    imp = cfg.importance
    return A.importance_weights(
        old,
        mb.tokens.behavior_logprobs,
        mb.loss_mask,
        level=imp.level,
        mode=imp.mode,
        cap=imp.cap,
        low=imp.low,
    )


def uses_bf16(trainer: TrainerConfig, device: torch.device) -> bool:
    """Whether ``trainer.bf16`` asks for bf16 matmuls on ``device`` (``auto``: iff it has bf16
    units, :func:`coderl.policy.precision.has_bf16_units`)."""
    if trainer.bf16 == "auto":
        return has_bf16_units(device)
    return bool(trainer.bf16)


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


RATIO_METRICS = (
    "approx_kl",
    "clip_frac_low",
    "clip_frac_high",
    "dual_clip_frac",
    "ratio_mean",
    "ratio_max",
)
"""The metrics of the PPO ratio ``exp(logp - old_logp)`` (:func:`coderl.algorithms.policy_loss`):
measured only where the ratio can differ from 1 (:func:`train_step`)."""

GAP_METRICS = ("logprob_gap", "logprob_gap_max", "logprob_gap_kl")
"""The sampler/trainer gap, measured at the weights before the step's first optimizer step
(:func:`train_step` keeps the first epoch's; every other metric is the last epoch's)."""


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
    dp: DataParallel | None = None,
) -> dict[str, float]:
    """``trainer.update_epochs`` optimizer steps on ``batch`` (one per epoch); ``dp``: a
    sharded step on this rank's share (see :func:`accumulate_gradients`).

    Returns:
        The metrics of :func:`accumulate_gradients` and the optimizer step of the last epoch
        (after ``update_epochs - 1`` updates: ``loss``, ``pg_loss``, ``kl``, ``entropy``,
        ``value_loss``, the ratio's :data:`RATIO_METRICS`, ``grad_norm``, ``lr`` all describe
        one and the same update), except the sampler/trainer gap (:data:`GAP_METRICS`), the
        first epoch's (before any update). The ratio's are absent with ``old_logp="trainer"``
        and one epoch (ratio exactly 1: nothing clipped, KL 0, by construction); with
        ``old_logp="behaviour"`` and one epoch they measure trainer vs sampler (stale or
        mismatched behaviour logprobs). Plus
        ``optimizer_steps`` (this call), ``sequences``, ``trained_tokens``, and the work of the forward passes with gradients over every epoch
        (``forward_tokens``: token positions run; ``forward_attended``: causal query-key pairs
        per head and layer; :func:`coderl.policy.forward.work`; 0 in a sharded step, and the
        extra forward of ``importance.mode=mask`` is not counted).
    """
    params = [p for g in optimizer.param_groups for p in g["params"]]
    cache: dict[int, Tensor] = {}
    metrics: dict[str, float] = {}
    gap: dict[str, float] = {}
    work = {"forward_tokens": 0.0, "forward_attended": 0.0}  # over every epoch
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
            bf16=uses_bf16(trainer, next(model.parameters()).device),
            max_tokens=trainer.max_tokens_per_micro_batch,
            checkpoint=trainer.activation_checkpointing,
            dp=dp,
        )
        m.update(optimizer_step(params, optimizer, scheduler, trainer.grad_clip))
        work = {k: v + m[k] for k, v in work.items()}
        # every per-update metric from the last epoch (its loss, KL and clipping agree); the
        # gap before the update from the first, before any optimizer step moved the policy
        gap = {k: m[k] for k in GAP_METRICS if k in m} if epoch == 0 else gap
        metrics = {**m, **gap}
    if trainer.update_epochs == 1 and alg.old_logp == "trainer":
        for k in RATIO_METRICS:  # old is this very forward: ratio 1, nothing clipped, KL 0
            metrics.pop(k, None)
    metrics.update(
        optimizer_steps=float(trainer.update_epochs),
        sequences=float(batch.size),
        trained_tokens=float(batch.loss_mask.sum()),
        **work,
    )
    return metrics
