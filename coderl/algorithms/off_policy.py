"""Importance weights that correct for sampler/trainer mismatch and policy staleness."""

from __future__ import annotations

import torch
from torch import Tensor

from coderl.algorithms.losses import LOG_RATIO_CLAMP

IW_LEVELS = ("token", "sequence")
IW_MODES = ("truncate", "mask")


def importance_weights(
    train_logp: Tensor,
    behavior_logp: Tensor,
    mask: Tensor,
    *,
    level: str = "token",
    mode: str = "truncate",
    cap: float = 2.0,
    low: float | None = None,
) -> Tensor:
    """Importance weights ``pi_train / pi_behaviour`` for off-policy correction.

    The tokens were sampled by a behaviour policy (an inference engine, possibly several weight
    versions old); the trainer's policy differs. Per token ``w_t = exp(train_logp - behavior_logp)``.

    - ``level="token"``: one weight per token.
    - ``level="sequence"``: one weight per row, the *geometric mean* of its token ratios,
      ``exp(mean_t log w_t)`` over masked-in tokens (never the product, whose scale grows with
      length; GSPO, Zheng et al. 2025, Eq. 7), broadcast to every token of the row.
    - ``mode="truncate"``: ``min(w, cap)`` and, if ``low`` is set, ``max(w, low)`` (truncated
      importance sampling, Ionides 2008; Yao et al. 2025, "Your Efficient RL Framework Secretly
      Brings You Off-Policy RL Training", TIS).
    - ``mode="mask"``: weights outside ``[low, cap]`` (``low`` None means 0) become 0, those
      inside are kept as they are (masked importance sampling, same source).

    Log-ratios are clamped to ``[-20, 20]`` before ``exp``, so the result is finite for any finite
    input. The weights carry no gradient.

    Args:
        train_logp: ``[B, T]`` trainer-side logprobs of the sampled tokens.
        behavior_logp: ``[B, T]`` logprobs recorded by the sampler for the same tokens.
        mask: ``[B, T]`` bool or 0/1; 1 on sampled (trainable) tokens.
        level: ``"token"`` or ``"sequence"``.
        mode: ``"truncate"`` or ``"mask"``.
        cap: upper bound (> 0).
        low: lower bound or None.

    Returns:
        ``[B, T]`` float weights, 0 where ``mask`` is 0.

    Raises:
        ValueError: unknown level or mode (lists the valid ones), mismatched shapes, ``cap <= 0``
            or ``low > cap``.
    """
    if level not in IW_LEVELS:
        raise ValueError(f"unknown importance-weight level {level!r}; valid: {list(IW_LEVELS)}")
    if mode not in IW_MODES:
        raise ValueError(f"unknown importance-weight mode {mode!r}; valid: {list(IW_MODES)}")
    if not (train_logp.shape == behavior_logp.shape == mask.shape):
        raise ValueError(
            f"shape mismatch: train_logp {tuple(train_logp.shape)}, behavior_logp "
            f"{tuple(behavior_logp.shape)}, mask {tuple(mask.shape)}"
        )
    if cap <= 0 or (low is not None and low > cap):
        raise ValueError(f"need 0 < cap and low <= cap; got cap={cap}, low={low}")
    with torch.no_grad():
        m = mask.to(torch.bool)
        zero = torch.zeros_like(train_logp)
        log_w = torch.where(m, train_logp - torch.where(m, behavior_logp, zero), zero)
        log_w = log_w.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # (B, T)
        if level == "sequence":
            n = m.sum(-1, keepdim=True).clamp(min=1)  # (B, 1)
            log_w = (log_w.sum(-1, keepdim=True) / n).expand_as(log_w)  # (B, T)
        w = log_w.exp()
        if mode == "truncate":
            w = w.clamp(min=low, max=cap)
        else:
            keep = (w <= cap) & (w >= (low if low is not None else 0.0))
            w = torch.where(keep, w, zero)
        return torch.where(m, w, zero)
