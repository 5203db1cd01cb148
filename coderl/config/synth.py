"""The ``tasks.synth`` and ``tasks.curriculum`` sections (task synthesis inside the loop,
``coderl.train.synth``; a curriculum by pass rate, ``coderl.train.curriculum``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from coderl.config._base import _Section


class SynthConfig(_Section):
    enabled: bool = False
    """Synthesise function-repair tasks inside the loop (``coderl.train.synth``) and admit them to
    the pool (``tasks.sampler: pool``, or the ``source`` entry of a mix, which must be a pool)."""
    proposer: str = "fnrepair"
    """What makes the new tasks: a key of ``coderl.train.synth.PROPOSERS`` (``fnrepair``:
    function-repair tasks from the training seeds; ``repo``: new bugs in the training
    repositories, stated at a level of the repository ladder, ``coderl.tasks.ladder``)."""
    source: str | None = None
    """With ``tasks.mix``: the label of the entry that receives the new tasks (None: no mix); a
    label with ``{level}`` (e.g. ``repo-L{level}``) names one entry per level, and a task goes to
    its level's entry."""
    min_active: int = Field(4, ge=0)
    """Synthesise when fewer tasks than this are active (running pass rate strictly in (0, 1))."""
    saturate: float = Field(0.8, gt=0, le=1)
    """A difficulty level whose pooled pass rate reaches this is saturated: synthesise at the
    next level up."""
    floor: float = Field(0.05, ge=0, lt=1)
    """A target level whose pooled pass rate is at most this is too hard: go one level down."""
    target: float = Field(0.5, gt=0, lt=1)
    """The pass rate synthesis aims at: the level whose pooled pass rate is nearest is chosen."""
    min_samples: int = Field(16, ge=1)
    """Outcomes a level needs before its pass rate counts."""
    start_level: int = Field(0, ge=0, le=4)
    """Level proposed when no level has ``min_samples`` outcomes yet."""
    per_request: int = Field(8, ge=1)
    """Tasks proposed per synthesis request (each then validated in fresh sandboxes)."""
    lag: int = Field(1, ge=1)
    """Ticks (sampler metric calls: one per step, one before the first) between a request and
    the admission of its validated tasks; the request runs in the background meanwhile and the
    admission waits for it if it is late, so a resumed run admits exactly what an uninterrupted
    one does."""
    max_tasks: int = Field(2000, ge=1)
    """The pool never grows beyond this many tasks."""
    repos: list[str] = Field(default_factory=list)
    """``repo`` proposer: the training repositories (names in ``data/repos.txt``) new bugs are
    made in (empty: every training repository with a built environment); a held-out one is an
    error."""
    max_tries: int = Field(40, ge=1)
    """``repo`` proposer: mutants run per request (each a test-suite run in a sandbox)."""
    executor: Literal["process", "thread"] = "process"
    """Where requests run: a spawned process (default: off the trainer's GIL, and CPython 3.11's
    ``ast`` is not thread-safe) or a thread (in-process proposers, tests)."""


class CurriculumConfig(_Section):
    order: list[str] = Field(min_length=2)
    """``tasks.mix`` labels from the first stage to the last (e.g. fnrepair, humaneval, repo)."""
    advance_at: float = Field(0.5, gt=0, le=1)
    """Move to the next stage when the current stage's recent pass rate reaches this."""
    min_samples: int = Field(32, ge=1)
    """Episodes of the current stage needed (since it began) before it can advance."""
    window: int = Field(64, ge=1)
    """Recent valid episodes of a stage whose resolved rate is its pass rate."""
    replay: float = Field(0.2, ge=0, lt=1)
    """Share of each step kept on the earlier stages (split evenly); the current stage gets the
    rest, later stages none."""
