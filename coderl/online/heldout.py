"""The gate's held-out evaluation: the code ``coderl eval`` and ``coderl train`` run.

:class:`EnvEvaluator` is the only evaluator of the online wing. It evaluates a policy (or any
engine: the cycle hands in ``engine.kind``'s engine over each registry version, vLLM included)
on the run's environment (``tasks.source``, built by :func:`coderl.envs.build_environment`: the
harness's multi-turn episodes in a sandbox, the same graders as training) with
:func:`coderl.eval.passk.evaluate`, on the first ``online.eval.limit`` tasks of
``tasks.heldout_split``. Candidate and champion get the same seeds (``online.eval.seed``), so
their per-task scores are paired for the gate's paired bound. The episode budgets are the
harness's, as in ``coderl eval``: ``rollout.max_turns``, ``rollout.max_new_tokens`` per turn,
``rollout.max_context_tokens``.

A population's suite (``online.populations``) is the same environment's held-out tasks whose
id matches its ``task_filter``; with a ``house_style`` a resolved episode passes only when every
Python file its final diff leaves behind keeps the style
(:func:`coderl.online.suites.diff_keeps_house_style`, a static
:mod:`ast` check of the post-image, never run). Only function tasks (HumanEval) carry their
workspace in the task, so house styles apply to them alone (a repository task with a style
raises).

Scores: ``pass@1`` per task (passing samples / samples; a dropped or ungraded episode is a
failure, as in ``evaluate``). Behaviour, for the gate's behaviour rules: ``edit_rate`` (share of
episodes whose final diff is not empty), ``broken_call_rate`` (share of episodes with a broken
tool call), ``broken_calls`` (per episode), ``grading_errors`` and ``dropped_episodes`` (counts).
``suspected_hack_rate``: the share of episodes any detector of :mod:`coderl.rewards.hacks` flags
(the detectors training runs, on the episode's tool log and diff).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Protocol

from coderl.config import Config
from coderl.config.online import PopulationConfig
from coderl.envs import build_environment
from coderl.eval.passk import eval_phase, evaluate, shown_batches
from coderl.online.monitors import SUSPECTED_HACK_RATE
from coderl.online.suites import diff_keeps_house_style
from coderl.progress import PhaseProgress
from coderl.rewards.hacks import detect_hacks, suspected_hack_rate
from coderl.train.pipeline import sampling_params


@dataclass
class EvalResult:
    """Per-task scores (paired across policies by task order) and behaviour metrics."""

    scores: dict[str, list[float]]
    behaviour: dict[str, float]
    task_ids: list[str]
    views: list[Any] = field(default_factory=list)
    """Each episode as a :class:`~coderl.graders.judge.EpisodeView` (task statement, diff, tool
    log, test outcomes): what the gate's gameability probes transform."""


class Evaluator(Protocol):
    def __call__(self, policy: Any) -> EvalResult: ...


class EnvEvaluator:
    """A policy -> its held-out :class:`EvalResult` (see the module docstring).

    Args:
        cfg: the online run's config (``tasks`` says the environment, ``online.eval`` the
            number of tasks, samples, temperature and seed).
        population: evaluate its suite (its ``task_filter`` and ``house_style``); None: the
            shared suite.

    Raises:
        ValueError: the population's filter matches no held-out task.
    """

    def __init__(self, cfg: Config, population: PopulationConfig | None = None) -> None:
        self.cfg = cfg
        self.env = build_environment(cfg)
        tasks = self.env.tasks(cfg.tasks.heldout_split)
        pattern = population.task_filter if population else None
        if pattern is not None:
            tasks = [t for t in tasks if re.search(pattern, t.id)]
            if not tasks:
                raise ValueError(f"task_filter {pattern!r} matches no held-out task")
        self.tasks = tasks[: cfg.online.eval.limit] if cfg.online.eval.limit else tasks
        self.style = population.house_style if population else None

    def __call__(self, policy: Any) -> EvalResult:
        e = self.cfg.online.eval
        episodes: list[tuple[Any, bool]] = []
        graded: list[tuple[Any, Any, Any]] = []
        name = eval_phase("gate held-out", e.samples)
        with PhaseProgress(name, len(self.tasks), enabled=self.cfg.progress) as bar:
            res = evaluate(
                self.env,
                policy,
                self.tasks,
                samples=e.samples,
                ks=[1],
                params=sampling_params(self.cfg, e.seed, e.temperature),
                tasks_per_batch=max(1, self.cfg.eval.batch_episodes // e.samples),  # as eval
                episodes_out=episodes,
                graded_out=graded,
                on_batch=shown_batches(bar, e.samples),
            )
        passed = {t.id: 0 for t in self.tasks}
        for task, ep, g in graded:
            ok = g.resolved and g.grading_error is None
            passed[task.id] += ok and diff_keeps_house_style(task, ep.answer or "", self.style)
        flags = [detect_hacks(ep, g, task) for task, ep, g in graded]
        n = max(len(episodes), 1)
        behaviour = {
            "edit_rate": sum(bool(v.diff.strip()) for v, _ in episodes) / n,
            "broken_call_rate": res.broken_episode_rate,
            "broken_calls": res.broken_calls,
            "grading_errors": float(res.grading_errors),
            "dropped_episodes": float(res.dropped_episodes),
            SUSPECTED_HACK_RATE: suspected_hack_rate(flags),
        }
        return EvalResult(
            {"pass@1": [passed[t.id] / e.samples for t in self.tasks]},
            behaviour,
            [t.id for t in self.tasks],
            [v for v, _ in episodes],
        )
