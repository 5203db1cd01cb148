"""Where a branched episode forks: the turn boundaries of :class:`BranchSpec`.

The harness's half of branched rollouts (the loop that forks lives in
:mod:`coderl.agent.episode`); the values estimated from the continuations are
:func:`coderl.algorithms.mc_turn_values` (VinePPO, Kazemnejad et al. 2024, Sec. 4).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BranchSpec:
    """Turn boundaries ``s_t`` (``t`` >= 1: after ``t`` turns) at which an episode forks ``k``
    continuations. Off when ``k`` is 0 or no boundary is named.

    Raises:
        ValueError: a negative ``k`` or ``every``, or a boundary below 1.
    """

    turns: tuple[int, ...] = ()
    """Boundaries to fork at, e.g. ``(1, 2)``: after the first and after the second turn."""
    every: int = 0
    """Also fork at every multiple of this many turns (0: only ``turns``)."""
    k: int = 0
    """Continuations per boundary."""

    def __post_init__(self) -> None:
        if self.k < 0 or self.every < 0 or any(t < 1 for t in self.turns):
            raise ValueError(
                f"BranchSpec: k={self.k} and every={self.every} must be >= 0 and turns "
                f"{self.turns} >= 1 (s_0 is the group's own start)"
            )

    def at(self, turn: int) -> bool:
        """Whether the boundary after ``turn`` turns forks."""
        if self.k == 0 or turn < 1:
            return False
        return turn in self.turns or (self.every > 0 and turn % self.every == 0)
