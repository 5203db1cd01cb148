"""Importance weights that correct for sampler/trainer mismatch and policy staleness, and the
sampler/trainer logprob gap that measures that mismatch."""

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
      inside are kept as they are (masked importance sampling, MIS: Liu et al. 2025, "When Speed
      Kills Stability: Demystifying RL Collapse from the Training-Inference Mismatch"). A 0 is a
      rejection: :func:`coderl.algorithms.policy_loss` drops such tokens from the loss and from
      its normaliser, and the trainer step drops them from every term's mask (they are not
      "kept with weight 0", which would shrink the loss with the number rejected).

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
        ``[B, T]`` float weights, 0 where ``mask`` is 0 and (mode ``"mask"``) where rejected;
        every other weight is > 0 (at least ``exp(-20)``).

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


def logprob_gap(train_logp: Tensor, behavior_logp: Tensor, mask: Tensor) -> dict[str, float]:
    """How far the trainer's logprobs are from the sampler's on the sampled tokens.

    The one sampler/trainer gap metric: the trainer step, the local policy's check and the async
    runs all report it. With ``d = train_logp - behavior_logp`` over tokens where ``mask`` is 1
    (computed in float64):

    - ``logprob_gap``: mean ``|d|`` (nats);
    - ``logprob_gap_max``: max ``|d|``;
    - ``logprob_gap_kl``: mean ``exp(d) - 1 - d``, the k3 estimate of KL(behaviour || trainer)
      (Schulman 2020, "Approximating KL Divergence"; ``d`` clamped at 20 before ``exp``).

    All three are 0 when no token is masked in. Staleness and sampler/trainer numerics both widen
    the gap.

    Args:
        train_logp, behavior_logp: ``[B, T]`` float logprobs of the same sampled tokens.
        mask: ``[B, T]`` bool or 0/1.

    Raises:
        ValueError: shapes differ.
    """
    if not (train_logp.shape == behavior_logp.shape == mask.shape):
        raise ValueError(
            f"shape mismatch: train {tuple(train_logp.shape)}, behaviour "
            f"{tuple(behavior_logp.shape)}, mask {tuple(mask.shape)}"
        )
    with torch.no_grad():
        m = mask.to(torch.bool)
        d = (train_logp.double() - behavior_logp.double())[m]  # (N,)
        if d.numel() == 0:
            return {"logprob_gap": 0.0, "logprob_gap_max": 0.0, "logprob_gap_kl": 0.0}
        return {
            "logprob_gap": float(d.abs().mean()),
            "logprob_gap_max": float(d.abs().max()),
            "logprob_gap_kl": float((d.clamp(max=LOG_RATIO_CLAMP).exp() - 1 - d).mean()),
        }
