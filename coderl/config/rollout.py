"""The ``rollout:`` section: how episodes are sampled, and where they branch."""

from __future__ import annotations

from pydantic import Field, model_validator

from coderl.config._base import _Section


class BranchConfig(_Section):
    turns: list[int] = Field(default_factory=list)
    """Turn boundaries to fork continuations at (``[1, 2]``: after the first and the second
    turn); used by ``algorithm.advantage=vineppo``."""
    every: int = Field(0, ge=0)
    """Also fork at every multiple of this many turns (0: only ``turns``)."""
    k: int = Field(0, ge=0)
    """Continuations per boundary (0: no branching)."""

    @model_validator(mode="after")
    def _boundaries(self) -> BranchConfig:
        if any(t < 1 for t in self.turns):
            raise ValueError(f"turns {self.turns}: boundaries are >= 1 (s_0 is the group's start)")
        if self.k > 0 and not self.turns and not self.every:
            raise ValueError("k > 0 needs turns or every (where to fork)")
        return self


class RolloutConfig(_Section):
    group_size: int = Field(8, ge=1)
    """Episodes per task (G); group baselines compare episodes of the same task."""
    max_turns: int = Field(3, ge=1)
    """Agent turns per episode."""
    max_new_tokens: int = Field(256, ge=1)
    """Token budget of one model turn."""
    max_context_tokens: int = Field(2048, ge=64)
    """Context window of one segment; the harness summarises or stops beyond it."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature; trainer logprobs use the same temperature."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus mass; keep 1.0 for unbiased logprobs."""
    concurrency: int = Field(8, ge=1)
    """Episodes run at once (batched generation, parallel sandboxes)."""
    branch: BranchConfig = Field(default_factory=BranchConfig)
    """Continuations forked at turn boundaries of training episodes (never in evaluation):
    ``k`` per boundary, each a conversation copy over a fork of the sandbox, graded like an
    episode; their rewards are ``vineppo``'s values."""
