"""The gate's held-out evaluation through the code ``coderl eval`` runs.

:class:`EnvEvaluator` evaluates a policy on the run's environment (``tasks.source``, built by
:func:`coderl.envs.build_environment`: the harness's multi-turn episodes in a sandbox, the same
graders as training and ``coderl eval``) with :func:`coderl.eval.passk.evaluate`, on the first
``online.eval.limit`` tasks of ``tasks.heldout_split``. Candidate and champion get the same
seeds (``online.eval.seed``), so their per-task scores are paired for the gate's paired bound.
The episode budgets are the harness's, as in ``coderl eval``: ``rollout.max_turns``,
``rollout.max_new_tokens`` per turn, ``rollout.max_context_tokens`` (``online.eval.
max_new_tokens`` is the single-turn suite's budget and is not read here).

Scores: ``pass@1`` per task (resolved samples / samples). Behaviour, for the gate's behaviour
rules: ``edit_rate`` (share of episodes whose final diff is not empty), ``broken_call_rate``
(share of episodes with a broken tool call), ``broken_calls`` (per episode), ``grading_errors``
and ``dropped_episodes`` (counts; both scored as failures by ``evaluate``).

``suspected_hack_rate``: the share of episodes any detector of :mod:`coderl.rewards.hacks`
flags (the detectors training runs, on the episode's tool log and diff), so the gate compares
champion and candidate on it.

Selected with ``online.eval.suite: env``. Not here yet: population suites with house styles (they still use
:class:`coderl.online.simulate.HeldoutEvaluator`), and sampling through a vLLM engine (the cycle
hands in the in-process policy of each registry version).
"""

from __future__ import annotations

from typing import Any

from coderl.config import Config
from coderl.envs import build_environment
from coderl.eval.passk import evaluate
from coderl.online.monitors import SUSPECTED_HACK_RATE
from coderl.online.simulate import EvalResult
from coderl.policy.base import SamplingParams
from coderl.rewards.hacks import detect_hacks, suspected_hack_rate


class EnvEvaluator:
    """A policy -> its held-out :class:`~coderl.online.simulate.EvalResult` (see the module
    docstring).

    Args:
        cfg: the online run's config (``tasks`` says the environment, ``online.eval`` the
            budget and seeds).
    """

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.env = build_environment(cfg)
        tasks = self.env.tasks(cfg.tasks.heldout_split)
        self.tasks = tasks[: cfg.online.eval.limit] if cfg.online.eval.limit else tasks

    def __call__(self, policy: Any) -> EvalResult:
        e = self.cfg.online.eval
        params = SamplingParams(
            temperature=e.temperature, max_new_tokens=e.max_new_tokens, seed=e.seed
        )
        episodes: list[tuple[Any, bool]] = []
        graded: list[tuple[Any, Any, Any]] = []
        res = evaluate(
            self.env,
            policy,
            self.tasks,
            samples=e.samples,
            ks=[1],
            params=params,
            tasks_per_batch=max(1, self.cfg.eval.batch_episodes // e.samples),  # as coderl eval
            episodes_out=episodes,
            graded_out=graded,
        )
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
        scores = [t["correct"] / t["n"] for t in res.per_task]
        return EvalResult(
            {"pass@1": scores},
            behaviour,
            [t["task_id"] for t in res.per_task],
            [v for v, _ in episodes],
        )
