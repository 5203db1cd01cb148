"""``toy``: a one-turn, in-process task that needs no sandbox, for tests and smoke runs."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from coderl.envs.base import EpisodeRecord, GradeRecord, SamplingPolicy
from coderl.policy.base import SamplingParams, check_finish_reason
from coderl.trajectory import Segment, Trajectory


@dataclass
class ToyTask:
    id: str
    prompt_ids: list[int]
    residue: int
    """The task is solved by sampling tokens whose id is ``residue`` modulo ``modulus``."""
    modulus: int = 4
    split: str = "train"


@dataclass
class ToyEnvironment:
    """Task ``toy/<split>/i``: after a fixed prompt, sample tokens whose id is congruent to the task's
    residue (``i mod residues``; with the default ``residues=1`` every task wants the same
    class) modulo ``modulus``. ``fraction_passed`` is the fraction of sampled
    tokens that are; resolved means at least half are. A random policy scores about
    ``1 / modulus``; a learning one climbs.

    Not a coding task: it exercises the drivers (sampling, grading, rewards, advantages, update,
    checkpoints) in milliseconds with a tiny random model.
    """

    max_new_tokens: int = 8
    modulus: int = 4
    residues: int = 1
    n_train: int = 16
    n_heldout: int = 8
    n_outside: int = 0
    """Tasks of a third split, ``outside`` (absent when 0): only evaluated, with
    ``eval.extra_splits: [outside]``, as the repair demo's kept-back set."""
    prefix: str = "toy"
    """Task ids are ``<prefix>/<split>/<i>`` (two toy sources in one ``tasks.mix`` need two)."""
    _tasks: dict[str, list[ToyTask]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        def make(i: int, split: str) -> ToyTask:
            prompt = [3 + (i * 7 + j) % 97 for j in range(4 + i % 3)]
            return ToyTask(
                f"{self.prefix}/{split}/{i}", prompt, i % self.residues, self.modulus, split
            )

        self._tasks = {
            "train": [make(i, "train") for i in range(self.n_train)],
            "heldout": [make(100 + i, "heldout") for i in range(self.n_heldout)],
        }
        if self.n_outside:
            self._tasks["outside"] = [make(200 + i, "outside") for i in range(self.n_outside)]

    def tasks(self, split: str) -> list[Any]:
        if split not in self._tasks:
            raise ValueError(f"unknown toy split {split!r}; valid: {sorted(self._tasks)}")
        return list(self._tasks[split])

    def ease(self, task: Any) -> float | None:
        return None

    def token_budget(self) -> int:
        return self.max_new_tokens

    def rollout(
        self, policy: SamplingPolicy, tasks: list[Any], params: SamplingParams, group_size: int
    ) -> list[EpisodeRecord]:
        prompts = [t.prompt_ids for t in tasks for _ in range(group_size)]
        params = replace(params, max_new_tokens=min(params.max_new_tokens, self.max_new_tokens))
        completions = policy.generate(prompts, params)
        episodes = []
        for i, c in enumerate(completions):
            check_finish_reason(c)  # "truncated" below must not guess
            seg = Segment()
            seg.append_context(prompts[i], kind="prompt")
            seg.append_sampled(c.token_ids, c.logprobs, c.versions())
            episodes.append(
                EpisodeRecord(
                    task_id=tasks[i // group_size].id,
                    trajectory=Trajectory([seg]),
                    finish_reason=c.finish_reason,
                    truncated=c.finish_reason == "length",
                    answer=c.token_ids,
                )
            )
        return episodes

    def grade(self, tasks: list[Any], episodes: list[EpisodeRecord]) -> list[GradeRecord]:
        out = []
        for task, ep in zip(tasks, episodes, strict=True):
            toks = ep.answer or []
            frac = sum(t % task.modulus == task.residue for t in toks) / max(len(toks), 1)
            out.append(GradeRecord(resolved=frac >= 0.5, fraction_passed=frac))
        return out
