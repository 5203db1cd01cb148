"""Trajectory types: what the model saw and sampled, token for token.

A :class:`Trajectory` is a list of :class:`Segment` s; each segment is one context window. The
trainer consumes segments as they are: sampled tokens are never re-tokenized from text.
Segments are built by :class:`coderl.policy.episode.EpisodeBuilder` (chat-template rendering,
observation deltas) and turned into padded tensors by :func:`coderl.policy.batch.collate`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Segment:
    """One context window of an episode.

    All per-token lists have the same length ``T`` (tokens):

    - ``token_ids``: the exact token ids in the context, prompt and observations included.
    - ``loss_mask``: 1 only on tokens the policy sampled (trainable), 0 on prompt, observations,
      template scaffolding inserted by the harness and padding.
    - ``behavior_logprobs``: logprob of each sampled token under the distribution it was sampled
      from (temperature applied); 0.0 on tokens the policy did not sample.
    - ``policy_versions``: weight version that produced each sampled token; -1 on tokens the
      policy did not sample.
    - ``provenance``: free-form audit data (episode id, turn boundaries, template name...).
      :class:`~coderl.policy.episode.EpisodeBuilder` records ``"spans"``: a list of
      ``[kind, start, end]`` with kind in ``{"prompt", "action", "observation"}``, and per action
      the sampling temperature and ``finish_reason``. :meth:`untrain` records ``"untrained"``:
      ``[start, end, reason]`` runs of sampled tokens taken out of the loss.

    Sampled but untrained (:meth:`untrain`): tokens the policy sampled that the loss must not
    see (those after an episode's ``submit`` call, :mod:`coderl.agent.episode`) keep their
    behaviour logprobs and versions but get ``loss_mask`` 0, so the policy loss, the importance
    ratios and the KL-in-loss statistics all skip them; reward terms that measure what was
    sampled (length, KL-in-reward) still count them (:attr:`num_sampled`, :meth:`sampled_mask`).
    """

    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    behavior_logprobs: list[float] = field(default_factory=list)
    policy_versions: list[int] = field(default_factory=list)
    provenance: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.token_ids)

    def append_context(self, token_ids: Sequence[int], kind: str = "observation") -> None:
        """Append tokens the policy did not sample (prompt, observation, template scaffolding).

        They get ``loss_mask`` 0, behaviour logprob 0.0 and version -1, and a provenance span.
        """
        self._append(token_ids, 0, [0.0] * len(token_ids), [-1] * len(token_ids), kind)

    def append_sampled(
        self, token_ids: Sequence[int], logprobs: Sequence[float], version: int | Sequence[int]
    ) -> None:
        """Append tokens the policy sampled, with their behaviour logprobs and weight version
        (one for all of them, or one per token: :meth:`coderl.policy.base.Completion.versions`
        after an in-flight weight update).

        Raises:
            ValueError: lengths differ, a logprob is not finite or positive, or the segment is
                empty (a sampled token needs a prefix to be sampled from).
        """
        if len(token_ids) != len(logprobs):
            raise ValueError(f"{len(token_ids)} sampled tokens but {len(logprobs)} logprobs")
        versions = [version] * len(token_ids) if isinstance(version, int) else list(version)
        if len(versions) != len(token_ids):
            raise ValueError(f"{len(token_ids)} sampled tokens but {len(versions)} versions")
        if not self.token_ids and token_ids:
            raise ValueError("a segment cannot start with sampled tokens: append the prompt first")
        bad = [x for x in logprobs if not (math.isfinite(x) and x <= 0.0)]
        if bad:
            raise ValueError(f"behaviour logprobs must be finite and <= 0, got {bad[:3]}")
        self._append(token_ids, 1, list(logprobs), versions, "action")

    def _append(
        self,
        token_ids: Sequence[int],
        mask: int,
        logprobs: list[float],
        versions: list[int],
        kind: str,
    ) -> None:
        start = len(self.token_ids)
        self.token_ids.extend(int(t) for t in token_ids)
        self.loss_mask.extend([mask] * len(token_ids))
        self.behavior_logprobs.extend(logprobs)
        self.policy_versions.extend(versions)
        self.provenance.setdefault("spans", []).append([kind, start, len(self.token_ids)])

    def validate(self) -> None:
        """Check the invariants the trainer relies on.

        Raises:
            ValueError: per-token lists of different lengths, a mask value other than 0/1, a
                trainable first token (it has no prefix), or a trainable token without a finite
                behaviour logprob or a version.
        """
        n = len(self.token_ids)
        lengths = {
            "loss_mask": len(self.loss_mask),
            "behavior_logprobs": len(self.behavior_logprobs),
            "policy_versions": len(self.policy_versions),
        }
        if any(v != n for v in lengths.values()):
            raise ValueError(f"segment has {n} token_ids but lengths {lengths}")
        if any(m not in (0, 1) for m in self.loss_mask):
            raise ValueError("loss_mask values must be 0 or 1")
        if n and self.loss_mask[0]:
            raise ValueError("the first token of a segment cannot be trainable (no prefix)")
        for t, (m, lp, v) in enumerate(
            zip(self.loss_mask, self.behavior_logprobs, self.policy_versions, strict=True)
        ):
            if m and (not math.isfinite(lp) or v < 0):
                raise ValueError(f"trainable token {t} has logprob {lp} and version {v}")

    @property
    def num_trainable(self) -> int:
        """Number of tokens with ``loss_mask`` 1."""
        return sum(self.loss_mask)

    def untrain(self, start: int, reason: str) -> int:
        """Take the trainable tokens from ``start`` to the end of the segment out of the loss
        (``loss_mask`` 0); their logprobs and versions stay, and the run is recorded in
        ``provenance["untrained"]`` as ``[start, end, reason]``.

        Returns:
            How many tokens were trainable and no longer are (0: nothing recorded).

        Raises:
            ValueError: ``start`` outside ``[0, len(self)]``.
        """
        n = len(self.token_ids)
        if not 0 <= start <= n:
            raise ValueError(f"untrain start {start} outside a segment of {n} tokens")
        count = sum(self.loss_mask[start:])
        if count:
            self.loss_mask[start:] = [0] * (n - start)
            self.provenance.setdefault("untrained", []).append([start, n, reason])
        return count

    def sampled_mask(self) -> list[int]:
        """1 on every token the policy sampled, trained or not (:meth:`untrain`), 0 elsewhere."""
        mask = list(self.loss_mask)
        for start, end, _ in self.provenance.get("untrained", []):
            for t in range(start, end):
                mask[t] = int(self.policy_versions[t] >= 0)
        return mask

    @property
    def num_sampled(self) -> int:
        """Number of tokens the policy sampled, trained or not (:meth:`sampled_mask`)."""
        return sum(self.sampled_mask())


@dataclass
class Trajectory:
    """An episode's segments; every segment shares the episode's final reward."""

    segments: list[Segment] = field(default_factory=list)


PREFILL_KEYS = ("distinct_tokens", "prompt_tokens", "prefill_tokens")
"""The keys of :func:`prefill_accounting`."""


def prefill_accounting(trajectory: Trajectory) -> dict[str, int]:
    """What an episode's sampling calls ask the engine to prefill, from its token-exact segments
    (each run of sampled tokens, ``loss_mask`` 1, is one call whose prompt is everything before
    it in its context window).

    Returns:
        ``distinct_tokens``: tokens of the episode's context windows (each must be computed at
        least once); ``prompt_tokens``: the calls' prompt lengths summed (what a sampler without
        KV reuse prefills); ``prefill_tokens``: what is left to prefill when a call reuses the KV
        of the previous call of its window (its prompt and completion less the last sampled
        token, never fed to the model), the rule of :mod:`coderl.policy.prefixcache`, with no
        eviction and without the sharing between a group's episodes that the engine also does.
    """
    distinct = prompt = prefill = 0
    for seg in trajectory.segments:
        distinct += len(seg.token_ids)
        cached = 0  # tokens of this window whose KV the previous call left
        prev = 0
        for i, m in enumerate(seg.loss_mask):
            if m and not prev:  # a call starts: its prompt is token_ids[:i]
                prompt += i
                prefill += i - cached
            if prev and not m:  # the call ended at i: its last sampled token was not fed
                cached = i - 1
            prev = m
    return {"distinct_tokens": distinct, "prompt_tokens": prompt, "prefill_tokens": prefill}


def kv_metrics(infos: list[dict[str, Any]]) -> dict[str, float]:
    """Multi-turn KV reuse of a step's episodes (rows holding each episode's
    :func:`prefill_accounting`, as ``coderl.train.pipeline.episode_info`` writes them), per
    episode: ``kv/distinct_tokens``, ``kv/prompt_tokens`` (prefill without reuse),
    ``kv/prefill_tokens`` (prefill when each call reuses its window's previous call), and
    ``kv/prefill_per_distinct`` (sum of prefill over sum of distinct tokens; NaN: no tokens)."""
    d = max(len(infos), 1)
    m = {f"kv/{k}": sum(x.get(k, 0) for x in infos) / d for k in PREFILL_KEYS}
    distinct = sum(x.get("distinct_tokens", 0) for x in infos)
    prefill = sum(x.get("prefill_tokens", 0) for x in infos)
    m["kv/prefill_per_distinct"] = prefill / distinct if distinct else math.nan
    return m
