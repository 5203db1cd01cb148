"""Held-out evaluation: pass@k (unbiased) and best-of-n over a task split, with 95% confidence
intervals from a bootstrap over tasks, the broken-call rate, the paired change between two
evaluations of the same tasks (:func:`compare`), and the collapse alarm of a run's periodic
evaluations (:func:`collapse_check`).

The statistics live in :mod:`coderl.stats` (percentile bootstrap over tasks; before/after
comparisons by the paired bootstrap of per-task differences, :func:`paired_difference`, which is
what decides whether an improvement excludes zero); they are re-exported here. The per-task
estimates that get paired come from :func:`coderl.algorithms.pass_at_k`, the one pass@k.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from coderl import algorithms as A
from coderl.graders.judge import EpisodeView
from coderl.metrics import masked_hint
from coderl.policy.base import SamplingParams
from coderl.rewards.learned import learned_fields
from coderl.stats import Estimate, NothingMeasured, bootstrap_ci, estimate, paired_difference
from coderl.tasks.ladder import family
from coderl.trajectory import PREFILL_KEYS, prefill_accounting

__all__ = [
    "Estimate",
    "EvalResult",
    "bootstrap_ci",
    "check_measured",
    "estimate",
    "CollapseCheck",
    "Comparison",
    "collapse_check",
    "compare",
    "evaluate",
    "paired_change",
    "paired_difference",
    "summarize",
]


@dataclass
class EvalResult:
    """Evaluation of one policy on one task split."""

    samples: int
    """n: samples per task."""
    pass_at: dict[str, Estimate] = field(default_factory=dict)
    """``"1"``, ``"16"``... -> unbiased pass@k (Chen et al. 2021, Eq. 1) over tasks with CI."""
    best_of_n: Estimate | None = None
    """Mean over tasks of the best ``fraction_passed`` among the n samples."""
    per_task: list[dict[str, Any]] = field(default_factory=list)
    """``{"task_id", "source", "n", "correct", "best", "f2p", "episodes", "broken_calls",
    "broken_episodes", "tool_episodes"}`` per task (for paired comparisons): ``source`` is the task's family in
    the summary (:func:`coderl.tasks.ladder.family`: ``level L<k>`` for a variant of the
    repository ladder, else its :attr:`~coderl.tasks.spec.Task.source`; None for tasks without
    one); ``f2p`` is the mean over the n samples
    of the fraction of FAIL_TO_PASS tests passed (0 for a sample that is missing or whose grading
    failed; absent for a task without FAIL_TO_PASS tests, such as the toy task); ``episodes`` returned by the environment, the broken tool calls among them and how
    many had at least one, and how many had their replies parsed as tool calls (0: the broken
    counts measure nothing); ``summarised``, ``continued``, ``continued_resolved`` and the
    prefill accounting summed over the task's episodes (see :attr:`context`)."""
    grading_errors: int = 0
    """Episodes whose grading failed, or that the harness failed as infrastructure (a prompt
    that never fit the window): counted as failures, in the denominator."""
    grading_error_examples: list[str] = field(default_factory=list)
    """Up to three distinct ``grading_error`` texts, to say why episodes were masked."""
    dropped_episodes: int = 0
    """Episodes the environment did not return (counted as failures, in the denominator)."""
    broken_calls: float = 0.0
    """Broken tool calls (unparseable, unknown tool, bad arguments) per returned episode."""
    broken_episode_rate: float = 0.0
    """Share of returned episodes with at least one broken tool call."""
    context: dict[str, float] = field(default_factory=dict)
    """Over returned episodes: ``multi_turn`` (episodes of more than one model turn: without
    one, KV reuse across turns measures nothing), ``summarised`` (episodes with a self-summary), ``continued``
    (of those, episodes that took a turn in the window the summary opened),
    ``continued_resolved`` (of those, resolved), each a count; ``distinct_tokens``,
    ``prompt_tokens`` and ``prefill_tokens`` per episode
    (:func:`coderl.trajectory.prefill_accounting`)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def per_task_pass(per_task: list[dict[str, Any]], ks: list[int]) -> list[dict[str, Any]]:
    """Each task's row with its unbiased pass@k (Chen et al. 2021, Eq. 1, from its ``n`` samples
    and ``correct`` count) under ``pass_at`` (``"1"`` -> value), for each k up to its ``n``;
    the mean over rows of ``pass_at[k]`` is :func:`summarize`'s pass@k."""
    return [
        t | {"pass_at": {str(k): A.pass_at_k(t["n"], t["correct"], k) for k in ks if k <= t["n"]}}
        for t in per_task
    ]


def summarize(
    per_task: list[dict[str, Any]], ks: list[int], samples: int, grading_errors: int = 0
) -> EvalResult:
    """pass@k for each k and best-of-n from per-task ``n``/``correct``/``best`` counts.

    Raises:
        ValueError: no tasks, or a k larger than a task's n.
    """
    if not per_task:
        raise ValueError("no tasks to summarize")
    res = EvalResult(samples=samples, per_task=per_task, grading_errors=grading_errors)
    for k in ks:
        if any(k > t["n"] for t in per_task):
            raise ValueError(f"pass@{k} needs at least {k} samples per task")
        vals = [A.pass_at_k(t["n"], t["correct"], k) for t in per_task]
        res.pass_at[str(k)] = estimate(vals)
    res.best_of_n = estimate([float(t["best"]) for t in per_task])
    episodes = sum(t.get("episodes", 0) for t in per_task)
    if episodes:
        res.broken_calls = sum(t["broken_calls"] for t in per_task) / episodes
        res.broken_episode_rate = sum(t["broken_episodes"] for t in per_task) / episodes
        counts = ("multi_turn", "summarised", "continued", "continued_resolved")
        res.context = {k: float(sum(t.get(k, 0) for t in per_task)) for k in counts}
        res.context.update({k: sum(t.get(k, 0) for t in per_task) / episodes for k in PREFILL_KEYS})
    return res


def _f2p(g: Any) -> float:
    """Fraction of FAIL_TO_PASS tests a graded sample passed (the grader's
    ``fail_to_pass_passed``; 0 when grading failed or the grader reports none)."""
    if g.grading_error is not None:
        return 0.0
    return float(getattr(g.result, "fail_to_pass_passed", 0.0))


def shown_batches(bar: Any, samples: int) -> Callable[[int, int], None]:
    """An ``on_batch`` for :func:`evaluate` that advances ``bar`` (a
    :class:`coderl.progress.PhaseProgress` over the tasks) with the samples resolved so far:
    ``resolved R of S samples``, the one progress line of every evaluation."""
    resolved = 0

    def batch_done(done: int, correct: int) -> None:
        nonlocal resolved
        resolved += correct
        bar.advance(done, status=f"resolved {resolved} of {(bar.done + done) * samples} samples")

    return batch_done


def eval_phase(what: str, samples: int) -> str:
    """The progress name of an evaluation: ``"<what> (<samples> samples/task)"``."""
    return f"{what} ({samples} sample{'s' if samples != 1 else ''}/task)"


def evaluate(
    env: Any,
    policy: Any,
    tasks: list[Any],
    *,
    samples: int,
    ks: list[int],
    params: SamplingParams,
    tasks_per_batch: int = 4,
    episodes_out: list[tuple[Any, bool]] | None = None,
    on_batch: Callable[[int, int], None] | None = None,
    graded_out: list[tuple[Any, Any, Any]] | None = None,
) -> EvalResult:
    """Sample ``samples`` episodes per task with ``env.rollout``, grade them, and summarize.

    Episodes are joined to their task by ``task_id``, never by position, so an environment that
    drops, adds or reorders episodes cannot move a result onto another task. Every task keeps
    ``n = samples``: an episode the environment did not return counts as a failure (counted in
    ``dropped_episodes``), and so does one whose grading failed (counted in
    ``grading_errors``): an evaluation must not look better because the harness or the grader
    broke.

    Args:
        env: a :class:`coderl.envs.Environment`.
        policy: what ``env.rollout`` samples from.
        tasks: the split to evaluate (distinct task ids).
        samples: n per task; ks: the k values (each <= n); params: sampling parameters (its seed
            is offset per batch of tasks so results do not depend on batching order).
        tasks_per_batch: tasks rolled out together.
        episodes_out: when given, each graded episode's
            :class:`~coderl.graders.judge.EpisodeView` (task statement, diff, tool log, test
            outcomes, as training's reward samples hold them) and whether it resolved the task
            are appended, in rollout order: what :func:`coderl.graders.pairs.write_episodes`
            writes for ``coderl rm train --episodes`` and ``coderl graders probe``.
        on_batch: called after each batch with (tasks evaluated in it, its resolved samples),
            e.g. a progress line.
        graded_out: when given, ``(task, EpisodeRecord, GradeRecord)`` of each graded episode
            is appended, in rollout order (what the hack detectors read, for the online gate).

    Raises:
        ValueError: duplicate task ids, an episode whose ``task_id`` is not a task of its batch,
            more than ``samples`` episodes for a task, or a grade count that differs from the
            episode count.
    """
    if len({t.id for t in tasks}) != len(tasks):
        raise ValueError("evaluate needs distinct task ids")
    per_task: list[dict[str, Any]] = []
    errors = dropped = 0
    examples: set[str] = set()
    for start in range(0, len(tasks), tasks_per_batch):
        chunk = tasks[start : start + tasks_per_batch]
        seed = None if params.seed is None else params.seed + start
        by_id = {t.id: t for t in chunk}
        graded = _rollout_and_grade(env, policy, by_id, replace(params, seed=seed), samples)
        joined: dict[str, list[tuple[Any, Any]]] = {t.id: [] for t in chunk}
        for ep, g in graded:
            task = by_id[ep.task_id]
            joined[task.id].append((ep, g))
            if graded_out is not None:
                graded_out.append((task, ep, g))
            if episodes_out is not None:
                view = EpisodeView(task.id, **learned_fields(task, ep, g))
                episodes_out.append((view, bool(g.resolved and g.grading_error is None)))
        for task in chunk:
            pairs = joined[task.id]
            per_task.append(_task_row(task, pairs, samples))
            dropped += samples - len(pairs)
            for ep, g in pairs:
                why = _masked_because(ep, g)
                errors += why is not None
                if why is not None and len(examples) < 3:
                    examples.add(why)
        if on_batch is not None:
            on_batch(len(chunk), sum(r["correct"] for r in per_task[-len(chunk) :]))
    res = summarize(per_task, ks, samples, errors)
    res.dropped_episodes = dropped
    res.grading_error_examples = sorted(examples)
    return res


def _masked_because(ep: Any, g: Any) -> str | None:
    """Why the episode ``ep`` graded ``g`` is no measurement, or None: a grading error, or an
    episode the harness failed as infrastructure (``failure="infra"``: a prompt that never fit
    the context window, a sandbox that broke), which training masks too. Counted with the
    grading errors; like them it scores as a failure."""
    if g.grading_error is not None:
        return str(g.grading_error)
    if getattr(ep, "failure", None) == "infra":
        return f"episode error: {getattr(ep, 'failure_reason', '') or 'harness error'}"
    return None


def check_measured(result: dict[str, Any], what: str = "eval") -> str | None:
    """Whether an evaluation (:meth:`EvalResult.to_dict`) measured anything: a warning line when
    at least half its episodes were masked (grading errors or dropped; they count as failures,
    so pass@k is then mostly a count of infrastructure faults), else None. Both say what to do
    where the grading errors name a known cause (:func:`coderl.metrics.masked_hint`: environments
    not built, a gateway program that never called the model, a prompt too long for the window).

    Raises:
        coderl.stats.NothingMeasured: every episode was masked (says why, with the first
            grading errors).
    """
    total = sum(t["n"] for t in result["per_task"])
    masked = result["grading_errors"] + result["dropped_episodes"]
    if total == 0 or masked < total / 2:
        return None
    examples = result.get("grading_error_examples", [])
    why = "; ".join(examples[:3]) or "-"
    said = (
        f"{masked} of {total} episodes masked ({result['grading_errors']} grading errors, "
        f"{result['dropped_episodes']} not returned by the environment); grading errors: {why}"
    )
    hint = masked_hint(examples)
    if masked >= total:
        raise NothingMeasured(
            f"{what}: nothing was measured: {said}" + (f" ({hint})" if hint else "")
        )
    return f"{what}: WARNING: {said}; pass@k counts them as failures" + (
        f" ({hint})" if hint else ""
    )


def _rollout_and_grade(
    env: Any, policy: Any, by_id: dict[str, Any], params: SamplingParams, samples: int
) -> list[tuple[Any, Any]]:
    """Roll out ``samples`` episodes for each task of ``by_id`` (id -> task) and grade them;
    ``(episode, grade)`` pairs in rollout order.

    Raises:
        ValueError: an episode whose ``task_id`` is not in ``by_id``, or a grade count that
            differs from the episode count.
    """
    episodes = env.rollout(policy, list(by_id.values()), params, samples)
    stray = sorted({ep.task_id for ep in episodes} - set(by_id))
    if stray:
        raise ValueError(f"episodes for tasks not in this batch: {stray}")
    owners = [by_id[ep.task_id] for ep in episodes]
    grades = env.grade(owners, episodes) if episodes else []
    if len(grades) != len(episodes):
        raise ValueError(f"{len(grades)} grades for {len(episodes)} episodes")
    return list(zip(episodes, grades, strict=True))


def _task_row(task: Any, pairs: list[tuple[Any, Any]], samples: int) -> dict[str, Any]:
    """One task's row of :attr:`EvalResult.per_task` from its ``(episode, grade)`` pairs; a
    missing sample or a failed grading counts as a failure (n stays ``samples``).

    Raises:
        ValueError: more than ``samples`` episodes for the task.
    """
    task_id = task.id
    if len(pairs) > samples:
        raise ValueError(f"task {task_id!r}: {len(pairs)} episodes for {samples} samples")
    grades = [g for _, g in pairs]
    ok = [x.resolved and x.grading_error is None for x in grades]
    best = max(
        ((x.fraction_passed if x.grading_error is None else 0.0) for x in grades), default=0.0
    )
    broken = [ep.broken_tool_calls for ep, _ in pairs]
    measured = bool(getattr(task, "FAIL_TO_PASS", None)) or any(
        hasattr(x.result, "fail_to_pass_passed") for x in grades
    )
    return {
        "task_id": task_id,
        "source": family(task),
        "n": samples,
        "correct": sum(ok),
        "best": best,
        # missing samples count as 0; absent for a task without FAIL_TO_PASS tests (toy)
        **({"f2p": sum(_f2p(x) for x in grades) / samples} if measured else {}),
        "episodes": len(broken),
        "broken_calls": sum(broken),
        "broken_episodes": sum(b > 0 for b in broken),
        "tool_episodes": sum(bool(getattr(ep, "parsed_calls", False)) for ep, _ in pairs),
        **_context_row(pairs),
    }


def _context_row(pairs: list[tuple[Any, Any]]) -> dict[str, int]:
    """Self-summaries and prefill accounting of one task's ``(episode, grade)`` pairs (see
    :attr:`EvalResult.context`); an episode without a trajectory counts zero tokens."""
    went_on = [(ep, g) for ep, g in pairs if getattr(ep, "turns_after_summary", 0) > 0]
    row = {
        "multi_turn": sum(getattr(ep, "turns", 1) > 1 for ep, _ in pairs),
        "summarised": sum(getattr(ep, "summaries", 0) > 0 for ep, _ in pairs),
        "continued": len(went_on),
        "continued_resolved": sum(bool(g.resolved) and g.grading_error is None for _, g in went_on),
        **dict.fromkeys(PREFILL_KEYS, 0),
    }
    for ep, _ in pairs:
        traj = getattr(ep, "trajectory", None)
        tokens = prefill_accounting(traj) if traj is not None else dict.fromkeys(PREFILL_KEYS, 0)
        for k in PREFILL_KEYS:
            row[k] += tokens[k]
    return row


def paired_change(
    before: list[dict[str, Any]], after: list[dict[str, Any]], k: int = 1, seed: int = 0
) -> Estimate:
    """Mean change of per-task pass@k from ``before`` to ``after`` (``EvalResult.per_task``
    lists) with its paired-bootstrap 95% CI (:func:`coderl.stats.paired_difference`, ``seed``
    fixes the resamples).

    Each task's pass@k is the unbiased estimate from its own ``n``/``correct`` (Chen et al. 2021,
    Eq. 1; for k = 1 it is ``correct / n``), so the two sides may use different ``n``. Tasks are
    paired by ``task_id``, never by position: two evaluations that list their tasks in another
    order still compare each task with itself.

    Raises:
        ValueError: the two lists do not hold the same task ids (or hold one twice), or a task
            has fewer than ``k`` samples.
    """
    b, a = ({t["task_id"]: t for t in side} for side in (before, after))
    if len(b) != len(before) or len(a) != len(after) or b.keys() != a.keys():
        raise ValueError(
            f"paired evaluations need the same distinct tasks: {len(before)} tasks "
            f"({len(b)} ids) vs {len(after)} ({len(a)} ids), "
            f"{len(b.keys() ^ a.keys())} ids on one side only"
        )

    def est(t: dict[str, Any]) -> float:
        if t["n"] < k:
            raise ValueError(f"task {t['task_id']!r}: pass@{k} needs >= {k} samples, has {t['n']}")
        return A.pass_at_k(t["n"], t["correct"], k)

    ids = sorted(b)
    return paired_difference([est(b[i]) for i in ids], [est(a[i]) for i in ids], seed)


def pooled_change(
    runs: list[tuple[list[dict[str, Any]], list[dict[str, Any]]]], k: int = 1, seed: int = 0
) -> Estimate:
    """Pass@k change pooled over several runs (training seeds) on one task set: each task's
    change (after - before, unbiased pass@k per side as in :func:`paired_change`) is averaged
    over the runs, then the mean over tasks gets its paired-bootstrap 95% CI
    (:func:`coderl.stats.paired_difference`: tasks resampled, ``seed`` fixes the resamples).

    ``runs`` holds one ``(before, after)`` pair of ``EvalResult.per_task`` lists per run. The
    CI is conditional on these runs: tasks are resampled, the runs are not (with three seeds a
    resample of seeds says little); read it beside each run's own change and their signs.

    Raises:
        ValueError: no runs, a run whose two sides differ in tasks (:func:`paired_change`), or
            runs evaluated on different task sets.
    """
    if not runs:
        raise ValueError("pooled_change needs at least one run")
    ids = sorted(t["task_id"] for t in runs[0][0])
    before = dict.fromkeys(ids, 0.0)
    after = dict.fromkeys(ids, 0.0)
    for i, (b, a) in enumerate(runs):
        paired_change(b, a, k, seed)  # the same checks: same tasks on both sides, n >= k
        if sorted(t["task_id"] for t in b) != ids:
            raise ValueError(f"run {i} was evaluated on other tasks than run 0: pool one task set")
        for side, acc in ((b, before), (a, after)):
            for t in side:
                acc[t["task_id"]] += A.pass_at_k(t["n"], t["correct"], k) / len(runs)
    return paired_difference([before[i] for i in ids], [after[i] for i in ids], seed)


@dataclass
class Comparison:
    """Two evaluations of the same tasks, side by side: what "did it get better, and did it
    collapse" reads from."""

    pass1: Estimate
    """Paired change of pass@1 (after - before) with its 95% CI."""
    k: int
    """The largest k both evaluations support (the smallest ``n`` of any task): the collapse
    check, since sharpening the distribution can raise pass@1 and lower pass@k."""
    passk_before: Estimate
    passk_after: Estimate
    passk: Estimate
    """Paired change of pass@``k``."""
    broken_calls: tuple[float, float]
    """Broken tool calls per episode, before and after."""
    broken_episode_rate: tuple[float, float]
    """Share of episodes with a broken tool call, before and after."""
    broken_change: Estimate | None = None
    """Paired change (after - before) of each task's broken calls per returned episode, with
    its 95% CI (None: a side returned no episode of some task, or the records predate the
    per-task counts)."""

    @property
    def excludes_zero(self) -> bool:
        """The 95% CI of the pass@1 change excludes zero (either side)."""
        return self.pass1.lo > 0 or self.pass1.hi < 0


def compare(before: dict[str, Any], after: dict[str, Any], seed: int = 0) -> Comparison:
    """Compare two evaluations (``EvalResult.to_dict()`` records, as ``eval.jsonl`` holds them):
    paired pass@1 change, pass@k at the largest common k before/after with its paired change,
    and the broken-call rates.

    Raises:
        ValueError: from :func:`paired_change` (different task sets).
    """
    bt, at = before["per_task"], after["per_task"]
    k = min(t["n"] for t in [*bt, *at])
    b, a = ({t["task_id"]: t for t in side} for side in (bt, at))
    ids = sorted(b)
    broken = None
    if all(side[i].get("episodes") for side in (a, b) for i in ids):
        rate = [[side[i]["broken_calls"] / side[i]["episodes"] for i in ids] for side in (b, a)]
        broken = paired_difference(rate[0], rate[1], seed)
    lone = [summarize(side, [k], k).pass_at[str(k)] for side in (bt, at)]
    return Comparison(
        pass1=paired_change(bt, at, 1, seed),
        k=k,
        passk_before=lone[0],
        passk_after=lone[1],
        passk=paired_change(bt, at, k, seed),
        broken_calls=(before.get("broken_calls", 0.0), after.get("broken_calls", 0.0)),
        broken_episode_rate=(
            before.get("broken_episode_rate", 0.0),
            after.get("broken_episode_rate", 0.0),
        ),
        broken_change=broken,
    )


@dataclass
class CollapseCheck:
    """One evaluation's pass@k at the largest k against the best earlier evaluation of the run
    (:func:`collapse_check`)."""

    alarm: bool
    """The upper end of the 95% CI of ``change`` is below 0: pass@k fell below the best earlier
    evaluation's by more than its CI."""
    drop: float
    """Best earlier pass@k minus this evaluation's (the mean of the paired per-task
    differences, negated): > 0 is a fall."""
    k: int
    """The largest k every compared evaluation holds (the smallest ``n`` of any task)."""
    best_step: int
    """Step of the best earlier evaluation."""
    change: Estimate
    """Paired change of pass@``k`` (this evaluation - the best earlier one) with its 95% CI."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def collapse_check(
    earlier: list[dict[str, Any]], current: dict[str, Any], seed: int = 0
) -> CollapseCheck | None:
    """The collapse alarm of one held-out evaluation; None when there is no earlier one to
    compare with.

    Rule: with ``k`` the largest k that ``current`` and every earlier evaluation support (the
    smallest per-task ``n``), take the earlier evaluation with the highest pass@k (the first
    of equals) and the paired change of per-task pass@k from it to ``current``
    (:func:`paired_change`: unbiased pass@k, Chen et al. 2021, Eq. 1; paired percentile
    bootstrap over tasks, Efron & Tibshirani 1993, Ch. 13; 95%). The alarm is raised when the
    upper end of that CI is below 0. pass@k at the largest k is the collapse check because RL
    that sharpens the sampling distribution can raise pass@1 while it lowers pass@k. The base
    model's evaluation (``phase: base``, before SFT) is not a reference: it measures the model
    before the recipe, often with fewer samples.

    Args:
        earlier: ``EvalResult.to_dict()`` records of the run's earlier evaluations, as
            ``eval.jsonl`` holds them (``step`` included).
        current: the new evaluation's record.

    Raises:
        ValueError: from :func:`paired_change` (an earlier evaluation of other tasks).
    """
    refs = [e for e in earlier if e.get("phase") != "base"]
    if not refs:
        return None
    k = min(t["n"] for e in [*refs, current] for t in e["per_task"])

    def passk(e: dict[str, Any]) -> float:
        return sum(A.pass_at_k(t["n"], t["correct"], k) for t in e["per_task"]) / len(e["per_task"])

    best = max(refs, key=passk)  # max returns the first of equals
    change = paired_change(best["per_task"], current["per_task"], k, seed)
    return CollapseCheck(change.hi < 0, 0.0 - change.mean, k, int(best["step"]), change)
