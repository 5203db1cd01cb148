"""Trajectory types: what the model saw and sampled, token for token.

A :class:`Trajectory` is a list of :class:`Segment` s; each segment is one context window. The
trainer consumes segments as they are: sampled tokens are never re-tokenized from text.
"""

from __future__ import annotations

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
      from (temperature applied); 0.0 where ``loss_mask`` is 0.
    - ``policy_versions``: weight version that produced each sampled token; -1 where
      ``loss_mask`` is 0.
    - ``provenance``: free-form audit data (episode id, turn boundaries, template name...).
    """

    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    behavior_logprobs: list[float] = field(default_factory=list)
    policy_versions: list[int] = field(default_factory=list)
    provenance: dict[str, Any] = field(default_factory=dict)


@dataclass
class Trajectory:
    """An episode's segments; every segment shares the episode's final reward."""

    segments: list[Segment] = field(default_factory=list)
