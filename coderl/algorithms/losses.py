"""Policy and value losses, KL estimators, loss aggregation and per-token statistics."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

# exp() of anything above this overflows float32 soon after; log-ratios are clamped to it.
LOG_RATIO_CLAMP = 20.0


def _check_same_shape(**tensors: Tensor) -> None:
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"shape mismatch: {shapes}")


def token_logprobs(logits: Tensor, tokens: Tensor, *, temperature: float = 1.0) -> Tensor:
    """Log-probabilities of ``tokens`` under ``softmax(logits / temperature)``.

    Temperature scales the logits *before* the softmax, as the sampler does, so these are the
    logprobs of the distribution a token was actually drawn from; the arithmetic
    (``log_softmax`` then ``gather``) is the sampler's too
    (:func:`coderl.policy.engine.sample_next`), so equal logits give bit-equal logprobs.

    Args:
        logits: ``[B, T, V]`` float (or any ``[..., V]``); position t holds the logits that
            predict ``tokens[:, t]``.
        tokens: ``[B, T]`` int64 token ids (``logits.shape[:-1]``).
        temperature: > 0.

    Returns:
        ``[B, T]`` float32 (or float64 if ``logits`` are) log-probabilities.

    Raises:
        ValueError: non-positive temperature or mismatched shapes.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits.shape[:-1] != tokens.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match tokens {tuple(tokens.shape)}")
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    logp = (logits.to(dtype) / temperature).log_softmax(-1)  # (B, T, V), as the sampler computes
    return logp.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)  # (B, T)


def entropy(logits: Tensor, mask: Tensor | None = None) -> Tensor:
    """Entropy ``H = -sum_v p_v log p_v`` of ``softmax(logits)`` over the last dimension.

    The one entropy of the package: the trainer forward
    (:func:`coderl.policy.forward.forward`) calls it on tempered logits, so the entropy it
    reports is that of the distribution each token was sampled from.

    Args:
        logits: ``[..., V]`` float (e.g. ``[B, T, V]``, or ``[N, V]`` at N sampled positions);
            divide by the temperature first for the tempered entropy.
        mask: ``[...]`` bool or 0/1, or None; positions with 0 get entropy 0.

    Returns:
        ``[...]`` float32 entropies in nats; reduce them with :func:`aggregate`.
    """
    logp = logits.float().log_softmax(-1)  # (..., V)
    h = -(logp.exp() * logp).sum(-1)  # (...)
    return h if mask is None else h * mask.to(h.dtype)


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: str) -> Tensor:
    """Per-token estimators of KL(policy || reference) from sampled-token logprobs.

    With ``log_r = ref_logp - logp`` (Schulman 2020, "Approximating KL Divergence", samples drawn
    from the policy pi):

    - ``"k1"``: ``-log_r`` (unbiased value, high variance, can be negative);
    - ``"k2"``: ``0.5 * log_r**2`` (biased value, low variance);
    - ``"k3"``: ``exp(log_r) - 1 - log_r`` (unbiased value, always >= 0; GRPO's choice, Shao et
      al. 2024, Eq. 4).

    Which one where. An unbiased *value* does not make an unbiased *gradient* when the estimate
    is differentiated as a loss (Tang & Munos 2025, "On a few pitfalls in KL divergence gradient
    estimation for RL", arXiv:2506.09477, their first pitfall). With x ~ pi and the sample held fixed:

    - ``grad k2 = (log pi - log ref) grad log pi``, whose expectation is
      ``grad KL(pi || ref)``: **k2 is the loss estimator** (:data:`KL_LOSS_ESTIMATOR`, what
      ``algorithm.kl`` puts into the trainer's loss);
    - ``grad k3 = (1 - ref / pi) grad log pi``, expectation ``-sum_x ref(x) grad log pi(x) =
      grad KL(ref || pi)``: the *other* direction (Zhang et al. 2025, "On the Design of
      KL-Regularized Policy Gradient Algorithms for LLM Reasoning", arXiv:2505.17508, show k3 is
      an unnormalised KL and correct GRPO's KL term);
    - ``grad k1 = grad log pi``, expectation 0: no regularisation at all.

    k1 and k3 are for values: the KL-in-reward term (k1 summed over an episode's tokens, a
    detached reward, :func:`coderl.rewards.terms.kl_term`) and logging. Limits of k2 as a loss:
    per token it gives the gradient of each token's KL at its sampled prefix, not the part that
    flows through the distribution of later prefixes (Tang & Munos 2025, second pitfall;
    KL-in-reward carries that part), and it is unbiased only for tokens sampled from the current policy (on
    later PPO epochs, or under sampler/trainer mismatch, it is off by the importance ratio; Zhang
    et al. 2025). ``tests/test_algorithms.py`` checks the three expected gradients by Monte Carlo
    on a small categorical policy.

    Clamp: for ``"k3"`` ``log_r`` is clamped to ``[-20, 20]`` before ``exp`` so the value stays
    finite; k1 and k2 are not clamped.

    Args:
        logp: ``[B, T]`` policy logprobs of the sampled tokens.
        ref_logp: ``[B, T]`` reference-policy logprobs of the same tokens.
        kind: one of ``KL_ESTIMATORS``.

    Returns:
        ``[B, T]`` elementwise estimates (mask and reduce them with :func:`aggregate`).

    Raises:
        ValueError: unknown ``kind`` (lists the valid ones) or mismatched shapes.
    """
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r}; valid: {sorted(KL_ESTIMATORS)}")
    _check_same_shape(logp=logp, ref_logp=ref_logp)
    return KL_ESTIMATORS[kind](ref_logp - logp)


def _k1(log_r: Tensor) -> Tensor:
    return -log_r


def _k2(log_r: Tensor) -> Tensor:
    return 0.5 * log_r.square()


def _k3(log_r: Tensor) -> Tensor:
    log_r = log_r.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return log_r.exp() - 1 - log_r


KL_ESTIMATORS: dict[str, Callable[[Tensor], Tensor]] = {"k1": _k1, "k2": _k2, "k3": _k3}

KL_LOSS_ESTIMATOR = "k2"
"""The estimator whose gradient, differentiated as a loss on on-policy samples, is
``grad KL(pi || ref)`` (see :func:`kl_penalty`); the only one ``algorithm.kl`` accepts."""


def aggregate(per_token: Tensor, mask: Tensor, mode: str, *, max_len: int | None = None) -> Tensor:
    """Reduce a per-token quantity (loss, KL, entropy) over the tokens where ``mask`` is 1.

    Modes (names as in verl's ``loss_agg_mode``):

    - ``"token-mean"``: sum over all tokens / number of tokens (DAPO, Yu et al. 2025, Sec. 3.3);
    - ``"seq-mean-token-mean"``: per-sequence token mean, then mean over sequences that have at
      least one token (the original GRPO objective, Shao et al. 2024, Eq. 3);
    - ``"seq-mean-token-sum"``: per-sequence token sum, then mean over the B rows;
    - ``"seq-mean-token-sum-norm"``: sum over all tokens / (B * max_len), a constant normaliser
      (Dr. GRPO, Liu et al. 2025, Sec. 3.2); ``max_len`` defaults to T, the padded length, so pass
      the generation budget explicitly to make it independent of padding.

    Args:
        per_token: ``[B, T]`` float.
        mask: ``[B, T]`` bool or 0/1; 1 marks tokens that count (sampled by the policy).
        mode: one of ``AGGREGATIONS``.
        max_len: the constant for ``"seq-mean-token-sum-norm"``.

    Returns:
        A 0-dim tensor; 0 when no token is masked in.

    Raises:
        ValueError: unknown mode (lists the valid ones), mismatched shapes, ``max_len`` < 1.
    """
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {mode!r}; valid: {sorted(AGGREGATIONS)}")
    _check_same_shape(per_token=per_token, mask=mask)
    if max_len is not None and max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    m = mask.to(per_token.dtype)
    x = torch.where(m > 0, per_token, torch.zeros_like(per_token))  # padding NaN cannot leak
    return AGGREGATIONS[mode](x, m, max_len)


def _token_mean(x: Tensor, m: Tensor, max_len: int | None) -> Tensor:
    return (x * m).sum() / m.sum().clamp(min=1)


def _seq_mean_token_mean(x: Tensor, m: Tensor, max_len: int | None) -> Tensor:
    n = m.sum(-1)  # (B,)
    per_seq = (x * m).sum(-1) / n.clamp(min=1)  # (B,)
    has = (n > 0).to(x.dtype)
    return (per_seq * has).sum() / has.sum().clamp(min=1)


def _seq_mean_token_sum(x: Tensor, m: Tensor, max_len: int | None) -> Tensor:
    return (x * m).sum(-1).mean()


def _seq_mean_token_sum_norm(x: Tensor, m: Tensor, max_len: int | None) -> Tensor:
    B, T = x.shape
    return (x * m).sum() / (B * (max_len if max_len is not None else T))


AGGREGATIONS: dict[str, Callable[[Tensor, Tensor, int | None], Tensor]] = {
    "token-mean": _token_mean,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum": _seq_mean_token_sum,
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
}


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    agg: str = "token-mean",
    max_len: int | None = None,
    weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO clipped surrogate loss with asymmetric clipping and optional dual clip.

    ``ratio = exp(logp - old_logp)``; per token
    ``L = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)``
    (Schulman et al. 2017, PPO, Eq. 7; clip-higher with ``clip_high > clip_low`` from DAPO, Yu et
    al. 2025, Sec. 3.1). With ``dual_clip = c > 1`` and ``A < 0`` the loss is further capped at
    ``-c * A`` (Ye et al. 2020, "Mastering Complex Control in MOBA Games", Eq. 5). ``weights``
    multiply the per-token loss as importance weights for sampler/trainer mismatch and staleness
    (see :func:`importance_weights`; they are treated as constants). A weight of exactly 0 is a
    rejected token (masked importance sampling): it leaves the loss *and its normaliser*, as if
    its mask were 0, so rejecting tokens does not shrink the loss of the ones kept (Liu et al.
    2025, "When Speed Kills Stability: Demystifying RL Collapse from the Training-Inference
    Mismatch": MIS rejects through the response mask, as verl's rollout correction does).

    Args:
        logp: ``[B, T]`` current-policy logprobs of the sampled tokens (requires grad).
        old_logp: ``[B, T]`` logprobs under the policy that sampled them (behaviour or the
            pre-update policy); must be finite at every trainable token.
        advantages: ``[B]`` (one per sequence) or ``[B, T]`` (per token).
        mask: ``[B, T]`` bool or 0/1; 1 on trainable (sampled) tokens, 0 on prompt, tool
            observations and padding.
        clip_low, clip_high: the clip range is ``[1 - clip_low, 1 + clip_high]``.
        dual_clip: ``c > 1`` or None.
        agg: aggregation mode, see :func:`aggregate`.
        max_len: for ``agg="seq-mean-token-sum-norm"``.
        weights: ``[B, T]`` per-token importance weights (>= 0; 0 rejects the token), or None.

    Returns:
        ``(loss, metrics)``: a 0-dim loss; metrics (floats over trainable tokens):
        ``clip_frac_low`` (ratio below ``1 - clip_low`` with A < 0, where the clip is active),
        ``clip_frac_high`` (ratio above ``1 + clip_high`` with A > 0), ``dual_clip_frac``,
        ``approx_kl`` (k3 estimate of KL(old || new), Schulman 2020), ``ratio_mean``,
        ``ratio_max``.

    Raises:
        ValueError: ``old_logp`` is None or non-finite at a trainable token (never silently ratio
            1), bad shapes, ``dual_clip <= 1``, negative clip ranges, a negative weight.
    """
    m, weights, advantages = _trainable_tokens(
        logp, old_logp, advantages, mask, weights, clip_low, clip_high, dual_clip
    )
    per_token, ratio, log_ratio, adv, dual_active = _clipped_surrogate(
        logp, old_logp, advantages, m, clip_low, clip_high, dual_clip
    )
    if weights is not None:
        per_token = per_token * weights
    loss = aggregate(per_token, m, agg, max_len=max_len)
    metrics = _ratio_metrics(ratio, log_ratio, adv, m, dual_active, clip_low, clip_high)
    return loss, metrics


def _trainable_tokens(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    weights: Tensor | None,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
) -> tuple[Tensor, Tensor | None, Tensor]:
    """Check :func:`policy_loss`'s inputs; return ``(m, weights, advantages)``.

    ``m`` is the ``[B, T]`` bool mask of tokens that count (trainable and not rejected by a zero
    importance weight), ``weights`` the detached ``[B, T]`` weights or None, ``advantages`` the
    ``[B, T]`` per-token advantages (a ``[B]`` input is broadcast over T). Raises the
    ``ValueError`` s listed in :func:`policy_loss`.
    """
    if old_logp is None:
        raise ValueError("old_logp is required: behaviour logprobs are missing")
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"clip ranges must be >= 0, got low={clip_low} high={clip_high}")
    if dual_clip is not None and dual_clip <= 1:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    _check_same_shape(logp=logp, old_logp=old_logp, mask=mask)
    m = mask.to(torch.bool)
    bad = m & ~torch.isfinite(old_logp)
    if bool(bad.any()):
        b, t = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"old_logp is non-finite at trainable token (row {b}, position {t}): "
            f"{old_logp[b, t].item()}; behaviour logprobs must be recorded for every sampled token"
        )
    if weights is not None:
        _check_same_shape(logp=logp, weights=weights)
        weights = weights.detach()
        if bool((m & (weights < 0)).any()):
            raise ValueError("importance weights must be >= 0")
        m = m & (weights > 0)  # rejected tokens leave the normaliser too
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1).expand_as(logp)  # (B,) -> (B, T)
    _check_same_shape(logp=logp, advantages=advantages)
    return m, weights, advantages


def _clipped_surrogate(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    m: Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Per-token PPO clipped (and dual-clipped) loss, before importance weights.

    The formula is :func:`policy_loss`'s (PPO Eq. 7, DAPO Sec. 3.1, dual clip Ye et al. 2020
    Eq. 5). All inputs and outputs are ``[B, T]``; ``m`` is the bool mask of tokens that count,
    and outside it the log-ratio and advantage are 0. Returns
    ``(per_token, ratio, log_ratio, adv, dual_active)``.
    """
    zero = torch.zeros_like(logp)
    log_ratio = torch.where(m, logp - torch.where(m, old_logp, zero), zero)
    log_ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = log_ratio.exp()  # (B, T)
    adv = torch.where(m, advantages, zero)
    surr = ratio * adv
    surr_clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * adv
    per_token = -torch.minimum(surr, surr_clipped)  # (B, T)
    dual_active = torch.zeros_like(m)
    if dual_clip is not None:
        cap = -dual_clip * adv
        dual_active = m & (adv < 0) & (per_token > cap)
        per_token = torch.where(adv < 0, torch.minimum(per_token, cap), per_token)
    return per_token, ratio, log_ratio, adv, dual_active


@torch.no_grad()
def _ratio_metrics(
    ratio: Tensor,
    log_ratio: Tensor,
    adv: Tensor,
    m: Tensor,
    dual_active: Tensor,
    clip_low: float,
    clip_high: float,
) -> dict[str, float]:
    """:func:`policy_loss`'s metrics (see its Returns) over the ``[B, T]`` tokens where ``m``."""
    n = m.sum().clamp(min=1).float()
    low = m & (adv < 0) & (ratio < 1 - clip_low)
    high = m & (adv > 0) & (ratio > 1 + clip_high)
    k3 = (ratio - 1) - log_ratio  # Schulman 2020's k3 estimate of KL(old || new)
    return {
        "clip_frac_low": float(low.sum() / n),
        "clip_frac_high": float(high.sum() / n),
        "dual_clip_frac": float(dual_active.sum() / n),
        "approx_kl": float((k3 * m).sum() / n),
        "ratio_mean": float((ratio * m).sum() / n),
        "ratio_max": float(ratio[m].max()) if bool(m.any()) else 1.0,
    }


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    *,
    clip: float | None = None,
    agg: str = "token-mean",
) -> Tensor:
    """Squared-error value loss with optional PPO value clipping.

    ``L = 0.5 * (V - R)^2``; with ``clip = c``:
    ``L = 0.5 * max((V - R)^2, (old_V + clip(V - old_V, -c, c) - R)^2)`` (the value clipping of
    OpenAI baselines' PPO2; Engstrom et al. 2020, "Implementation Matters", Sec. 3).

    Args:
        values: ``[B, T]`` current value predictions (requires grad).
        old_values: ``[B, T]`` predictions at rollout time.
        returns: ``[B, T]`` targets (e.g. from :func:`gae`).
        mask: ``[B, T]`` bool or 0/1; 1 on trainable tokens.
        clip: value clip range, or None for no clipping.
        agg: aggregation mode, see :func:`aggregate`.

    Returns:
        A 0-dim loss.

    Raises:
        ValueError: mismatched shapes or a negative clip.
    """
    _check_same_shape(values=values, old_values=old_values, returns=returns, mask=mask)
    err = (values - returns).square()
    if clip is not None:
        if clip < 0:
            raise ValueError(f"value clip must be >= 0, got {clip}")
        clipped = old_values + (values - old_values).clamp(-clip, clip)
        err = torch.maximum(err, (clipped - returns).square())
    return aggregate(0.5 * err, mask, agg)
