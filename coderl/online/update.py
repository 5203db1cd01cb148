"""The near-on-policy update: claimed production interactions -> one candidate's weights.

Only interactions that can be trained on exactly are kept; everything else is counted by reason:

- ``censored`` / ``unscored``: no reward under the batch's spec version;
- ``stale_version``: served by a version outside the last K promoted ones (near on-policy: the
  data must come from a policy close to the one being trained);
- ``greedy``: sampled at temperature 0 (its logprobs are not those of a sampling distribution);
- ``other_temperature``: sampled at a temperature the client chose, other than the training
  temperature. Exploration traffic (``exploration = true``, sampled by the server at
  ``online.exploration.temperature``) is kept: its logged logprobs are those of the tempered
  distribution it was drawn from, so ``pi_train(a) / mu_explore(a)`` is the exact importance
  ratio of what was sampled;
- ``top_p``: nucleus-truncated sampling (the logged logprobs are not the sampling distribution);
- ``missing_logprobs``: no behaviour logprobs logged;
- ``empty``: no completion tokens.

Metrics named "before the update" (the sampler/trainer gap, KL, importance weights) are the
first trainer step's, whatever ``trainer.steps`` is: later steps see weights this update moved.

The loss is the trainer's algorithm-blind step (:func:`coderl.train.step.train_step`): PPO
clipping against the trainer's own logprobs before the update, token-level truncated importance
weights ``min(pi_old / pi_behaviour, cap)`` against the logged behaviour logprobs
(:func:`coderl.algorithms.importance_weights`; decoupled PPO, Hilton et al. 2022, "Batch
size-invariance for policy optimization", Sec. 3), and a KL penalty to the current champion
(a frozen copy). The effective sample size of the importance weights is logged,
``ESS = (sum w)^2 / sum w^2`` (Kish 1965, "Survey Sampling", Sec. 11.7; Kong 1992; Liu 1996,
Eq. 2), per token and per sequence, and the share of exploration rows in the batch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from coderl.config import AlgorithmConfig, TrainerConfig
from coderl.endpoint.chat import calls_from_rows, trajectory_of
from coderl.progress import PhaseProgress
from coderl.train.batch import StepBatch
from coderl.train.optim import build_optimizer
from coderl.train.pipeline import token_batch
from coderl.train.step import behaviour_importance, train_step
from coderl.trajectory import Segment


@dataclass
class Selection:
    kept: list[dict[str, Any]] = field(default_factory=list)
    excluded: Counter[str] = field(default_factory=Counter)


def select_trainable(
    rows: Sequence[dict[str, Any]],
    rewards: dict[str, dict[str, Any]],
    *,
    allowed_versions: set[int],
    temperature: float,
    exploration_temperature: float | None = None,
) -> Selection:
    """Split interaction rows into trainable ones and exclusions counted by reason (see the
    module docstring).

    Args:
        exploration_temperature: the server's exploration temperature; rows flagged
            ``exploration`` at it are kept (None: exploration rows are held to ``temperature``
            like the rest).
    """
    sel = Selection()
    for r in rows:
        rw = rewards.get(r["interaction_id"])
        if rw is None:
            reason = "unscored"
        elif rw["status"] != "scored":
            reason = rw["status"]
        elif r["policy_version"] not in allowed_versions:
            reason = "stale_version"
        elif r["temperature"] == 0:
            reason = "greedy"
        elif abs(r["temperature"] - temperature) > 1e-9 and not (
            r.get("exploration")
            and exploration_temperature is not None
            and abs(r["temperature"] - exploration_temperature) <= 1e-9
        ):
            reason = "other_temperature"
        elif r["top_p"] < 1.0:
            reason = "top_p"
        elif not r["behaviour_logprobs"]:
            reason = "missing_logprobs" if r["completion_token_ids"] else "empty"
        else:
            sel.kept.append(r)
            continue
        sel.excluded[reason] += 1
    return sel


def to_segment(row: dict[str, Any]) -> Segment:
    """The exact tokens the policy saw and sampled (never re-tokenized): one interaction as a
    segment of its own, built by the segmenter of served and gateway episodes
    (:func:`coderl.endpoint.chat.trajectory_of`); the update weighs each interaction alone."""
    [seg] = trajectory_of(calls_from_rows([row]))[0].segments
    seg.provenance["interaction_id"] = row["interaction_id"]
    return seg


@torch.no_grad()
def effective_sample_size(weights: Tensor, mask: Tensor) -> dict[str, float]:
    """ESS of importance weights ``[B, T]`` over masked-in tokens, and per sequence (geometric
    mean of each row's token weights).

    Returns:
        ``ess_tokens``, ``ess_tokens_frac`` (ESS / tokens), ``ess_seqs``, ``ess_seqs_frac``.
    """
    m = mask.bool()
    w = weights[m]
    n = max(int(m.sum()), 1)
    ess_tok = float(w.sum() ** 2 / (w.pow(2).sum() + 1e-12))
    log_w = torch.where(m, weights.clamp(min=1e-12).log(), torch.zeros_like(weights))
    seq_w = (log_w.sum(-1) / m.sum(-1).clamp(min=1)).exp()  # (B,)
    ess_seq = float(seq_w.sum() ** 2 / (seq_w.pow(2).sum() + 1e-12))
    return {
        "ess_tokens": ess_tok,
        "ess_tokens_frac": ess_tok / n,
        "ess_seqs": ess_seq,
        "ess_seqs_frac": ess_seq / max(weights.shape[0], 1),
    }


@torch.no_grad()
def behaviour_weights(
    policy: Any, batch: StepBatch, algorithm: AlgorithmConfig, temperature: float
) -> Tensor:
    """The update's importance weights against the logged behaviour logprobs, ``[B, T]``
    float32: the policy's logprobs of the sampled tokens at the training ``temperature`` minus
    the logged ones, exponentiated and truncated (or masked) as ``algorithm.importance`` says
    (:func:`coderl.algorithms.importance_weights`); 0 off the loss mask. With
    ``importance.mode: off`` there are no weights, as in the offline trainer step: 1 on the
    loss mask."""
    if algorithm.importance.mode == "off":
        return batch.loss_mask.float()
    return behaviour_importance(
        algorithm, policy.forward(batch.tokens, temperature).logprobs, batch
    )


def update(
    policy: Any,
    champion: Any,
    rows: Sequence[dict[str, Any]],
    advantages: Tensor,
    *,
    algorithm: AlgorithmConfig,
    trainer: TrainerConfig,
    temperature: float,
    max_len: int,
    progress: bool = False,
) -> dict[str, float]:
    """Train ``policy`` (a :class:`coderl.policy.local.LocalPolicy` loaded from the champion)
    on the selected rows with ``trainer.steps`` calls of the trainer step.

    The batch comes from the drivers' one batch builder (:func:`coderl.train.pipeline.
    token_batch`), with the frozen champion as the KL reference.

    Args:
        champion: a frozen copy of the champion policy (KL reference).
        rows: trainable interaction rows (see :func:`select_trainable`).
        advantages: ``[B]`` float32 single-sample advantages, one per row.
        max_len: the generation budget (constant of ``seq-mean-token-sum-norm``).
        progress: show a progress line per step (``online train i/N``, elapsed, ETA).

    Returns:
        the trainer's metrics of the **first** step, measured before any optimizer step of
        this update (the sampler/trainer gap ``logprob_gap*``, ``iw_*``, ``ratio_*``,
        ``loss``, ``grad_norm``: what "before the update" promises, whatever ``trainer.steps``
        is), ``optimizer_steps`` summed over every step, the ESS metrics of the importance
        weights before the first (:func:`behaviour_weights`, :func:`effective_sample_size`) and
        ``exploration_share``, the share of exploration rows; ``kl`` to the champion at the
        last step's forward (after ``trainer.steps - 1`` optimizer steps), only when
        ``algorithm.kl.coef > 0`` and ``trainer.steps > 1`` (absent otherwise: never a 0
        that was not measured).

    Raises:
        ValueError: no rows, or ``len(advantages) != len(rows)``.
    """
    if not rows:
        raise ValueError("no trainable interactions")
    if len(advantages) != len(rows):
        raise ValueError(f"{len(advantages)} advantages for {len(rows)} rows")
    batch = token_batch(
        policy,
        [to_segment(r) for r in rows],
        advantages.tolist(),
        micro_batch_size=trainer.micro_batch_size,
        temperature=temperature,
        # the KL to the champion is measured only where it is penalised: else it is absent
        # (a first step's KL to the model it starts from is 0 by construction, not a reading)
        reference=(lambda tokens, t: champion.forward(tokens, t).logprobs)
        if algorithm.kl.coef > 0
        else None,
    )
    w = behaviour_weights(policy, batch, algorithm, temperature)  # (B, T)
    metrics = effective_sample_size(w, batch.loss_mask)
    metrics["exploration_share"] = sum(bool(r.get("exploration")) for r in rows) / len(rows)
    opt, sched = build_optimizer([{"params": policy.trainable_parameters()}], trainer)
    policy.model.train(False)  # no dropout: sampling and training see the same function
    steps: list[dict[str, float]] = []
    with PhaseProgress("online train", trainer.steps, enabled=progress) as bar:
        for _ in range(trainer.steps):
            steps.append(
                train_step(
                    policy.model,
                    opt,
                    sched,
                    batch,
                    algorithm,
                    trainer,
                    temperature=temperature,
                    max_len=max_len,
                )
            )
            policy.bump_version()
            bar.advance(
                status=f"{len(rows)} interactions, loss {steps[-1].get('loss', float('nan')):.4g}"
            )
    metrics.update(steps[0])  # before the update: the first step's forward saw the champion
    # ... so its KL to the champion is 0 by construction, not a reading: the last step's is
    # (after trainer.steps - 1 optimizer steps); with one step none is measured, and none shown
    metrics.pop("kl", None)
    if len(steps) > 1 and "kl" in steps[-1]:
        metrics["kl"] = steps[-1]["kl"]
    metrics["optimizer_steps"] = sum(m["optimizer_steps"] for m in steps)
    return metrics
