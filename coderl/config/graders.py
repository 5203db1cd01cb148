"""Config sections of the learned graders: ``reward.judge``, ``reward.rm`` and ``graders``.

They live here (not in :mod:`coderl.config`) so the graders own their settings; ``coderl.config``
only mounts them in the one config tree. Pydantic only: importing this module loads no model.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Section(BaseModel):
    model_config = ConfigDict(
        extra="forbid", use_attribute_docstrings=True, validate_assignment=True
    )


class JudgeConfig(_Section):
    model: str = "smollm2-135m"
    """Judge model: a registered name, a ``.gguf`` file or a Hugging Face directory (loaded once
    per process by :func:`coderl.rewards.learned.judge_term`)."""
    rubric: str = "configs/rubrics/code-quality.yaml"
    """Rubric file (criteria, weights, scales, wording, version)."""
    scoring: Literal["probability", "generate"] = "probability"
    """``probability``: the expected rating from the rating tokens' probabilities after a prompt
    that ends where the verdict goes (G-Eval; :mod:`coderl.graders.probjudge`; no reply, so
    nothing to parse or mask); ``generate``: the judge writes a JSON reply that is parsed
    strictly, retried once and masked when malformed (:mod:`coderl.graders.judge`; for judges
    that follow a schema)."""
    mode: Literal["pointwise", "group"] = "pointwise"
    """``pointwise``: one judgement per episode; ``group``: the G episodes of a task in one
    judgement, scored relative to each other (RULER-style)."""
    cache: str | None = "~/.cache/coderl/judge-cache.sqlite"
    """SQLite file of cached judgements keyed by (rubric version, judge model, input hash), ``~``
    expanded (the default is the user's cache directory, never the working directory); None: no
    cache."""
    max_new_tokens: int = Field(256, ge=8)
    """Tokens the judge may write per judgement (``scoring: generate`` only)."""
    temperature: float = Field(0.0, ge=0)
    """Judge sampling temperature (0: greedy). The retry after a malformed reply always
    samples at ``max(temperature, 0.7)`` with another seed, so it is not the same reply."""
    max_chars: int = Field(6000, ge=200)
    """Each field shown to the judge (statement, diff, tool log, tests) is cut to this many
    characters (head and tail kept)."""
    seed: int = 0
    """Seed of the judge's sampling."""


class RMConfig(_Section):
    checkpoint: str | None = None
    """Directory written by ``coderl rm train`` (``rm.safetensors`` + ``rm.json``); required
    when ``rm`` is in ``reward.terms``."""
    squash: bool = True
    """Map the raw Bradley-Terry score ``r`` to ``sigmoid(r)`` in (0, 1) so its scale matches the
    tests term; False gives ``r`` itself (unbounded)."""


class GradersConfig(_Section):
    probe_every: int = Field(0, ge=0)
    """Run the gameability probes every this many training steps (0: never)."""
    probes: list[str] = Field(default_factory=list)
    """Probe names from ``coderl.graders.probes.PROBES``; empty: all of them."""
    probe_episodes: int = Field(16, ge=1)
    """Episodes of the current step the probes transform (the first ones with a diff)."""
    max_shift: float = Field(0.0, ge=0)
    """A probe whose mean score shift has a 95% CI lower end above this raises the score:
    flagged, and the online gate fails."""
