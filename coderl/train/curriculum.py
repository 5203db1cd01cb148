"""``tasks.curriculum``: mix weights that advance by pass rate, not by step count.

The stages are ``tasks.mix`` labels in order (e.g. function repair, then HumanEval, then repository
tasks). A stage's pass rate is the resolved rate over its last ``window`` valid episodes (masked
episodes are not counted). The run starts at stage 0; once the current stage has had at least
``min_samples`` episodes since it began and its pass rate reaches ``advance_at``, the next stage
begins. Weights: the current stage gets ``1 - replay`` (all of it at stage 0), the earlier stages
share ``replay`` evenly (so what was learned keeps being practised), later stages get 0; labels
outside ``order`` get 0. It never moves back.

This is the competence-based curriculum of Platanios et al., 2019 ("Competence-based Curriculum
Learning for Neural Machine Translation", section 3), with the model's measured pass rate as the
competence instead of a schedule over steps. :class:`coderl.train.sampling.MixSampler` reads
:meth:`Curriculum.weights` when it allocates a block and feeds :meth:`Curriculum.observe` with each
episode's outcome; the state is in every checkpoint with the sampler's.
"""

from __future__ import annotations

import math
from typing import Any

from coderl.config import CurriculumConfig


class Curriculum:
    """The stage state of ``tasks.curriculum`` (module docstring)."""

    def __init__(self, cfg: CurriculumConfig) -> None:
        self.cfg = cfg
        self.stage = 0
        """Index into ``cfg.order`` of the current stage."""
        self.recent: dict[str, list[int]] = {k: [] for k in cfg.order}
        """Label -> its last ``window`` valid outcomes (1 resolved), oldest first."""
        self.since = 0
        """Valid episodes of the current stage since it began."""
        self.advanced_at: list[int] = []
        """Episodes seen (all stages) when each advance happened."""
        self.seen = 0

    def pass_rate(self, label: str) -> float:
        """Resolved rate over the label's recent valid episodes (NaN: none yet)."""
        xs = self.recent.get(label, [])
        return sum(xs) / len(xs) if xs else math.nan

    def weights(self, labels: list[str]) -> dict[str, float]:
        """Label -> weight at the current stage (module docstring)."""
        order, k = self.cfg.order, self.stage
        w = dict.fromkeys(labels, 0.0)
        w[order[k]] = 1.0 - (self.cfg.replay if k else 0.0)
        for earlier in order[:k]:
            w[earlier] = self.cfg.replay / k
        return w

    def observe(self, label: str, infos: list[dict[str, Any]]) -> None:
        """Outcomes of ``label``'s episodes (``valid``, ``resolved`` read); may advance a stage."""
        if label not in self.recent:
            return
        valid = [int(bool(x["resolved"])) for x in infos if x["valid"]]
        xs = self.recent[label]
        xs.extend(valid)
        del xs[: -self.cfg.window]
        self.seen += len(valid)
        current = self.cfg.order[self.stage]
        if label != current:
            return
        self.since += len(valid)
        last = self.stage == len(self.cfg.order) - 1
        if not last and self.since >= self.cfg.min_samples:
            if self.pass_rate(current) >= self.cfg.advance_at:
                self.stage += 1
                self.since = 0
                self.advanced_at.append(self.seen)

    def metrics(self) -> dict[str, float]:
        """``curriculum/stage`` and ``curriculum/<label>/pass_rate`` (recent window)."""
        m = {"curriculum/stage": float(self.stage)}
        m.update({f"curriculum/{k}/pass_rate": self.pass_rate(k) for k in self.cfg.order})
        return m

    def state_dict(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "recent": self.recent,
            "since": self.since,
            "advanced_at": self.advanced_at,
            "seen": self.seen,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stage = int(state.get("stage", 0))
        self.recent = {
            k: [int(x) for x in state.get("recent", {}).get(k, [])] for k in self.cfg.order
        }
        self.since = int(state.get("since", 0))
        self.advanced_at = [int(x) for x in state.get("advanced_at", [])]
        self.seen = int(state.get("seen", 0))
