"""Environments over the agent harness: HumanEval function tasks and synthesised repository
bug-fix tasks. Each episode runs in its own sandbox (:mod:`coderl.sandbox`), many at once
(:func:`coderl.agent.run_episodes`), and is graded in a fresh sandbox by
:func:`coderl.grading.grade.grade` (hidden tests). An episode the harness could not finish
(``finish_reason="error"``: an unexpected exception) is an ``infra`` failure and is masked; a grade
carries the grader's own failure kind (``infra`` when it names none).

Limits: sandboxes are started and closed here, one per episode; the repository environment of a
``repo`` task must already be built (``coderl tasks build-env``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from coderl.agent.branch import BranchSpec
from coderl.agent.episode import EpisodeConfig
from coderl.agent.runner import run_episodes
from coderl.config import Config
from coderl.envs.base import EpisodeRecord, FailureKind, GradeRecord, SamplingPolicy
from coderl.grading.grade import SETUP_FAULTS, rollout_sandbox
from coderl.grading.grade import grade as default_grade
from coderl.policy.base import SamplingParams
from coderl.pools import thread_pool
from coderl.progress import inner_progress, warn_masked
from coderl.tasks.spec import Task
from coderl.trajectory import Trajectory

log = logging.getLogger(__name__)

TRUNCATED = ("max_turns", "max_tokens")
"""Finish reasons that mean a budget ran out (not a submit or a broken-call stop)."""


def _last_line(text: str | None) -> str:
    lines = [line for line in (text or "").splitlines() if line.strip()]
    return lines[-1].strip() if lines else "harness error"


def _record(ep: Any) -> EpisodeRecord:
    """The driver's view of a harness episode (``finish_reason="error"``: an infra failure unless
    the harness names the agent)."""
    error = ep.stats.finish_reason == "error"
    failure: FailureKind | None = (ep.failure or "infra") if error else None
    return EpisodeRecord(
        task_id=ep.task_id,
        trajectory=ep.trajectory,
        finish_reason=ep.stats.finish_reason,
        turns=ep.stats.turns,
        truncated=ep.stats.finish_reason in TRUNCATED,
        broken_tool_calls=ep.stats.broken_tool_calls,
        parsed_calls=True,
        no_action_turns=ep.stats.no_action_turns,
        summaries=ep.stats.summaries,
        turns_after_summary=ep.stats.turns_after_summary,
        answer=ep.diff,
        episode=ep,
        failure=failure,
        failure_reason=_last_line(ep.error) if error else "",
        branches=[(b.turn, _record(b.episode)) for b in ep.branches],
    )


def sandbox_for(task: Task) -> Any:
    """A fresh sandbox holding the task's workspace (the caller closes it):
    :func:`coderl.grading.grade.rollout_sandbox`. Raises one of ``SETUP_FAULTS`` when it
    cannot start (masked and counted by the callers)."""
    return rollout_sandbox(task)


@dataclass
class AgentEnvironment:
    """Tasks from ``load(split)``, episodes from the agent harness, grades from hidden tests."""

    cfg: Config
    load: Callable[[str], list[Task]]
    grade_timeout_s: float = 60.0
    potential: Callable[[Any, Any], float | None] | None = None
    """The shaping potential measured by the harness after each ``run`` call
    (``EpisodeConfig.potential``), used only when branched rollouts are shaped
    (``reward.shaping > 0``); None: the tasks have none the harness can measure."""
    sandbox: Callable[[Task], Any] | None = None
    """A fresh rollout sandbox of a task (the caller closes it); None: :func:`sandbox_for`."""
    grader: Callable[..., Any] | None = None
    """``grader(task, diff, timeout=...) -> GradeResult``; None: :func:`coderl.grading.grade.grade`."""
    _cache: dict[str, list[Task]] = field(default_factory=dict)

    def tasks(self, split: str) -> list[Any]:
        if split not in self._cache:
            self._cache[split] = self.load(split)
        return list(self._cache[split])

    def ease(self, task: Any) -> float | None:
        return None  # the group pass rate decides (HumanEval and synthesised bugs carry no ease)

    def token_budget(self) -> int:
        return self.cfg.rollout.max_turns * self.cfg.rollout.max_new_tokens

    def episode_config(
        self, params: SamplingParams, branch: BranchSpec | None = None
    ) -> EpisodeConfig:
        r, branch = self.cfg.rollout, branch or BranchSpec()
        shaped = branch.k > 0 and self.cfg.reward.shaping > 0  # training rollouts of vineppo
        return EpisodeConfig(
            branch=branch,
            potential=self.potential if shaped else None,
            max_turns=r.max_turns,
            max_tokens=self.token_budget(),
            max_tokens_per_turn=r.max_new_tokens,
            context_budget=r.max_context_tokens,
            temperature=max(params.temperature, 1e-6),
            top_p=params.top_p,
            seed=params.seed,
            **self.cfg.tasks.options.get("episode", {}),
        )

    def rollout(
        self, policy: SamplingPolicy, tasks: list[Any], params: SamplingParams, group_size: int
    ) -> list[EpisodeRecord]:
        """Episodes in task-major order. An episode whose sandbox cannot start (the task's
        environment is missing, the sandbox fails) is an ``infra`` failure with an empty
        trajectory; the others run."""
        return self.rollout_branched(policy, tasks, params, group_size, BranchSpec())

    def rollout_branched(
        self,
        policy: SamplingPolicy,
        tasks: list[Any],
        params: SamplingParams,
        group_size: int,
        branch: BranchSpec,
    ) -> list[EpisodeRecord]:
        """:meth:`rollout` with continuations forked where ``branch`` says (each record's
        ``branches``; see :mod:`coderl.agent.episode`)."""
        owners = [t for t in tasks for _ in range(group_size)]
        started: dict[int, Any] = {}
        failed: dict[int, str] = {}
        try:
            for i, t in enumerate(owners):
                try:
                    started[i] = (self.sandbox or sandbox_for)(t)
                except SETUP_FAULTS as e:  # infrastructure: masked and counted
                    warn_masked(log, "task %s: sandbox could not start (masked)", t.id)
                    failed[i] = f"sandbox could not start: {type(e).__name__}: {e}"
            ran = iter(
                run_episodes(
                    policy,
                    [(owners[i], sb) for i, sb in started.items()],
                    self.episode_config(params, branch),
                    max_workers=self.cfg.rollout.concurrency,
                )
                if started
                else []
            )
        finally:
            for sb in started.values():
                sb.close()
        return [
            _record(next(ran))
            if i in started
            else EpisodeRecord(
                owners[i].id, Trajectory(), "error", 0, failure="infra", failure_reason=failed[i]
            )
            for i in range(len(owners))
        ]

    def grade(self, tasks: list[Any], episodes: list[EpisodeRecord]) -> list[GradeRecord]:
        grade = self.grader or default_grade

        def one(pair: tuple[Task, EpisodeRecord]) -> GradeRecord:
            task, ep = pair
            if ep.failure == "infra" and not ep.trajectory.segments:
                why = f" ({ep.failure_reason})" if ep.failure_reason else ""
                return GradeRecord(grading_error=f"not graded: the episode never ran{why}")
            try:
                g = grade(task, ep.answer or "", timeout=self.grade_timeout_s)
            except KeyboardInterrupt:
                raise
            # anything else, SystemExit included: the grader may be a plugin (the shipped
            # graders score what the agent's output makes them raise themselves); what it
            # raises is a host fault, masked and counted for this sample, never the batch's end
            except BaseException as e:  # noqa: BLE001 - a grader bug is infrastructure: masked
                warn_masked(log, "task %s: the grader raised (masked)", task.id)
                return GradeRecord(
                    grading_error=f"grader raised {type(e).__name__}: {e}", failure_kind="infra"
                )
            kind = getattr(g, "failure_kind", None)  # the grader's attribution, when it gives one
            # partial credit, not the share of all tests: PASS_TO_PASS would pay doing nothing
            return GradeRecord(
                g.resolved, g.partial_credit, g.grading_error, failure_kind=kind, result=g
            )

        graded: list[GradeRecord] = []
        with (
            thread_pool(self.cfg.rollout.concurrency) as pool,
            inner_progress("grading", len(episodes), every_s=10.0) as bar,
        ):
            resolved = 0
            for g in pool.map(one, zip(tasks, episodes, strict=True)):
                graded.append(g)
                resolved += bool(g.resolved)
                bar.advance(status=f"resolved {resolved}")
        return graded


def humaneval_environment(cfg: Config) -> AgentEnvironment:
    from coderl.tasks.humaneval import humaneval_tasks

    return AgentEnvironment(cfg, humaneval_tasks)


def repo_environment(cfg: Config) -> AgentEnvironment:
    """Repository bug-fix tasks, split by repository (:func:`coderl.tasks.repos.load_repo_tasks`):
    ``tasks.options.tasks_file`` (a path, glob or list; default every shipped
    ``data/tasks/*.jsonl.gz``) and ``tasks.options.repos_file`` (default ``data/repos.txt``, which
    assigns each repository to ``train`` or ``heldout``). ``tasks.options.ladder`` (a list of
    levels 0-3) replaces each task by its variants at those levels of the horizon ladder
    (:func:`coderl.tasks.ladder.ladder_tasks`; a level a task cannot have is left out)."""
    from coderl.tasks.ladder import ladder_tasks
    from coderl.tasks.repos import load_repo_tasks

    opts = cfg.tasks.options
    levels = opts.get("ladder")

    def load(split: str) -> list[Task]:
        tasks = load_repo_tasks(
            split, tasks_file=opts.get("tasks_file"), repos_file=opts.get("repos_file")
        )
        return tasks if levels is None else ladder_tasks(tasks, [int(x) for x in levels])

    return AgentEnvironment(cfg, load, grade_timeout_s=300.0)


def swebench_environment(cfg: Config) -> AgentEnvironment:
    """SWE-bench-format instances that bring their own image (``tasks.options.tasks_file``, read
    by :func:`coderl.tasks.swebench.read_image_tasks`; every instance in
    ``tasks.options.split``, default ``train``; ``tasks.options.namespace``: the registry
    namespace of SWE-bench's image naming scheme for instances that name no image, default
    ``swebench``): each episode runs in a container of the
    instance's image over its own ``/testbed`` (:func:`coderl.grading.harness.instance_sandbox`)
    and is graded by the instance's eval script in a fresh container of it with the diff
    applied (:func:`coderl.grading.harness.grade_image_task`)."""
    from coderl.grading.harness import grade_image_task, instance_sandbox
    from coderl.tasks.swebench import read_image_tasks, task_instance

    opts = cfg.tasks.options
    path, own = opts["tasks_file"], opts.get("split", "train")
    namespace = opts.get("namespace", "swebench")

    def load(split: str) -> list[Task]:
        return read_image_tasks(path, split=own, namespace=namespace) if split == own else []

    return AgentEnvironment(
        cfg,
        load,
        grade_timeout_s=1800.0,
        sandbox=lambda task: instance_sandbox(task_instance(task)),
        grader=grade_image_task,
    )
