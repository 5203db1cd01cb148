import pytest

from coderl.envs.base import EpisodeRecord, GradeRecord
from coderl.eval.passk import bootstrap_ci, evaluate, paired_difference, summarize
from coderl.policy.base import SamplingParams
from coderl.trajectory import Trajectory


def test_summarize_pass_at_k_and_best_of_n():
    per_task = [
        {"task_id": "a", "n": 4, "correct": 1, "best": 1.0},  # pass@1 1/4, pass@4 1
        {"task_id": "b", "n": 4, "correct": 0, "best": 0.5},  # 0, 0
        {"task_id": "c", "n": 4, "correct": 4, "best": 1.0},  # 1, 1
    ]
    res = summarize(per_task, [1, 4], 4)
    assert res.pass_at["1"].mean == pytest.approx((0.25 + 0 + 1) / 3)
    assert res.pass_at["4"].mean == pytest.approx(2 / 3)
    assert res.best_of_n.mean == pytest.approx(2.5 / 3)
    est = res.pass_at["1"]
    assert est.lo <= est.mean <= est.hi


def test_bootstrap_ci_is_degenerate_for_constant_values_and_wide_for_spread():
    assert bootstrap_ci([0.5] * 10) == (0.5, 0.5)
    lo, hi = bootstrap_ci([0.0, 1.0] * 10)
    assert lo < 0.5 < hi and hi - lo > 0.2


def test_paired_difference_excludes_zero_only_for_consistent_gains():
    before = [0.0] * 20
    assert paired_difference(before, [0.5] * 20).lo == pytest.approx(0.5)
    mixed = paired_difference(before, [1.0, -1.0] * 10)
    assert mixed.lo < 0 < mixed.hi
    with pytest.raises(ValueError, match="equal and non-empty"):
        paired_difference([0.0], [0.0, 1.0])


def test_summarize_refuses_k_below_1():
    with pytest.raises(ValueError):
        summarize([{"task_id": "a", "n": 2, "correct": 1, "best": 1.0}], [0], 2)


def test_paired_t_lower_hand_worked():
    from coderl.stats import paired_t_lower, student_t_quantile

    # d = [0.1, 0.3]: mean 0.2, sd sqrt(0.02) = 0.14142; n = 2 -> 0.2 - q * 0.14142 / 1.41421
    assert paired_t_lower([0.1, 0.3], 2.0) == pytest.approx(0.2 - 2.0 * 0.1)
    # all tied: the floor stands in for sd (0.5 / sqrt(4) = 0.25) -> 0 - q * 0.25 / 2
    assert paired_t_lower([0.0] * 4, 3.0, sd_floor=0.25) == pytest.approx(-0.375)
    assert student_t_quantile(0.975, 1) == pytest.approx(12.7062, abs=1e-4)  # t table, df = 1
    with pytest.raises(ValueError, match="at least 2"):
        paired_t_lower([1.0], 2.0)


class _Task:
    def __init__(self, id):
        self.id = id


class _ScriptedEnvironment:
    """Episode j of task t is resolved iff ``outcomes[t][j]``; ``drop`` lists (task, j) pairs the
    environment loses (a crashed sandbox); ``reverse`` returns the episodes in reverse order."""

    def __init__(self, outcomes, drop=(), reverse=False):
        self.outcomes, self.drop, self.reverse = outcomes, set(drop), reverse

    def rollout(self, policy, tasks, params, group_size):
        eps = [
            EpisodeRecord(task_id=t.id, trajectory=Trajectory(), answer=self.outcomes[t.id][j])
            for t in tasks
            for j in range(group_size)
            if (t.id, j) not in self.drop
        ]
        return eps[::-1] if self.reverse else eps

    def grade(self, tasks, episodes):
        for t, ep in zip(tasks, episodes, strict=True):
            assert t.id == ep.task_id  # graded against its own task
        return [
            GradeRecord(resolved=ep.answer, fraction_passed=float(ep.answer)) for ep in episodes
        ]


OUTCOMES = {"a": [True, True], "b": [True, False], "c": [True, True]}


def _evaluate(env, tasks_per_batch=3):
    tasks = [_Task(t) for t in OUTCOMES]
    return evaluate(
        env,
        None,
        tasks,
        samples=2,
        ks=[1],
        params=SamplingParams(),
        tasks_per_batch=tasks_per_batch,
    )


def test_evaluate_joins_by_task_and_counts_a_dropped_episode_as_a_failure():
    # b's first episode (a success) is dropped: b = 0 of 2, not 1 of 1, and c keeps its 2 of 2.
    # By position the 5 grades [a a b c c] would be cut as a=[a a] b=[b c] c=[c]: b would get
    # c's success and c would lose a sample from its denominator.
    res = _evaluate(_ScriptedEnvironment(OUTCOMES, drop=[("b", 0)]))
    per = {t["task_id"]: (t["n"], t["correct"], t["best"]) for t in res.per_task}
    assert per == {"a": (2, 2, 1.0), "b": (2, 0, 0.0), "c": (2, 2, 1.0)}
    assert res.pass_at["1"].mean == pytest.approx((1 + 0 + 1) / 3)
    assert res.dropped_episodes == 1 and res.grading_errors == 0
    # every episode of a task dropped: n stays 2, nothing correct
    res = _evaluate(_ScriptedEnvironment(OUTCOMES, drop=[("c", 0), ("c", 1)]), tasks_per_batch=1)
    assert res.per_task[2] == {
        "task_id": "c",
        "source": None,
        "n": 2,
        "correct": 0,
        "best": 0.0,  # no "f2p": the scripted task has no FAIL_TO_PASS tests, nothing graded
        "episodes": 0,
        "broken_calls": 0,
        "broken_episodes": 0,
        "tool_episodes": 0,
        "multi_turn": 0,
        "summarised": 0,
        "continued": 0,
        "continued_resolved": 0,
        "distinct_tokens": 0,
        "prompt_tokens": 0,
        "prefill_tokens": 0,
    }
    assert res.dropped_episodes == 2


def test_evaluate_does_not_depend_on_episode_order():
    in_order = _evaluate(_ScriptedEnvironment(OUTCOMES))
    reversed_ = _evaluate(_ScriptedEnvironment(OUTCOMES, reverse=True))
    assert in_order.per_task == reversed_.per_task
    assert [t["correct"] for t in in_order.per_task] == [2, 1, 2]


def test_evaluate_refuses_episodes_it_cannot_place():
    class Extra(_ScriptedEnvironment):
        def rollout(self, policy, tasks, params, group_size):
            eps = super().rollout(policy, tasks, params, group_size)
            return eps + [EpisodeRecord(task_id=self.extra, trajectory=Trajectory(), answer=True)]

    env = Extra(OUTCOMES)
    env.extra = "zz"
    with pytest.raises(ValueError, match="not in this batch"):
        _evaluate(env)
    env.extra = "a"  # a third episode for a task of n = 2
    with pytest.raises(ValueError, match="3 episodes for 2 samples"):
        _evaluate(env)


def test_pass_at_k_matches_enumerating_every_draw_of_k_samples():
    from itertools import combinations

    from coderl.algorithms import pass_at_k

    # Hand-worked: n = 4, c = 2, k = 2: 1 - C(2, 2) / C(4, 2) = 1 - 1/6 = 5/6.
    assert pass_at_k(4, 2, 2) == pytest.approx(5 / 6)
    # Chen et al.'s estimator is the share of k-subsets of the n samples holding a success.
    for n in (4, 6, 8):
        for c in range(n + 1):
            samples = [1] * c + [0] * (n - c)
            for k in range(1, n + 1):
                draws = list(combinations(samples, k))
                want = sum(any(d) for d in draws) / len(draws)
                assert pass_at_k(n, c, k) == pytest.approx(want), (n, c, k)


def test_summarize_refuses_a_k_above_n():
    with pytest.raises(ValueError, match="pass@8 needs at least 8 samples"):
        summarize([{"task_id": "a", "n": 4, "correct": 1, "best": 1.0}], [1, 8], 4)


def _per_task(correct, n=4, prefix="t"):
    return [
        {"task_id": f"{prefix}{i}", "n": n, "correct": c, "best": float(c > 0)}
        for i, c in enumerate(correct)
    ]


def test_paired_change_excludes_zero_for_a_gain_on_many_tasks():
    from coderl.eval.passk import paired_change

    # 64 tasks; after: 20 tasks gain one success of 4 (+0.25 each), none lose: +20/64 * 0.25.
    before = _per_task([0] * 44 + [1] * 20)
    after = _per_task([0] * 44 + [2] * 20)
    d = paired_change(before, after)
    assert d.mean == pytest.approx(20 / 64 * 0.25)
    assert 0 < d.lo < d.mean < d.hi


def test_paired_change_does_not_exclude_zero_for_an_equal_mix_of_gains_and_losses():
    from coderl.eval.passk import paired_change

    before = _per_task([2] * 40)
    after = _per_task([3, 1] * 20)  # every task moves by 0.25, half up, half down
    d = paired_change(before, after)
    assert d.mean == pytest.approx(0.0)
    assert d.lo < 0 < d.hi
    assert paired_change(before, after, seed=0) == d  # seeded: the same CI every time


def test_paired_change_pairs_by_task_id_not_position():
    from coderl.eval.passk import paired_change

    before = _per_task([0, 4, 0, 4])
    after = _per_task([0, 4, 0, 4])[::-1]  # the same results, listed in reverse
    d = paired_change(before, after)
    assert (d.mean, d.lo, d.hi) == (0.0, 0.0, 0.0)  # by position it would be +-1 per task
    with pytest.raises(ValueError, match="same distinct tasks"):
        paired_change(before, _per_task([0, 4, 0, 4], prefix="u"))
    with pytest.raises(ValueError, match="same distinct tasks"):
        paired_change(before, before[:3])
    with pytest.raises(ValueError, match="pass@8 needs >= 8 samples"):
        paired_change(before, before, k=8)


def test_compare_reads_the_collapse_check_at_the_largest_common_k():
    from coderl.eval.passk import compare

    # before: one success on each of 4 tasks (pass@1 0.25, pass@4 1); after: 4 of 4 on two tasks
    # and none on the others: pass@1 rises to 0.5, pass@4 falls to 0.5 (a sharpened policy)
    before = {"per_task": _per_task([1, 1, 1, 1]), "broken_calls": 0.5, "broken_episode_rate": 0.4}
    after = {"per_task": _per_task([4, 4, 0, 0]), "broken_calls": 0.1, "broken_episode_rate": 0.1}
    c = compare(before, after)
    assert c.pass1.mean == pytest.approx(0.25)
    assert c.k == 4
    assert (c.passk_before.mean, c.passk_after.mean) == (1.0, 0.5)
    assert c.passk.mean == pytest.approx(-0.5)
    assert c.broken_calls == (0.5, 0.1) and c.broken_episode_rate == (0.4, 0.1)


def test_the_summary_reports_each_task_family_with_its_own_paired_rl_change():
    from coderl.eval.summary import families, summary_lines

    # family "lib": 8 tasks, each 0 -> 2 of 4 after RL (+0.5 each, CI [0.5, 0.5]); family "he":
    # 8 tasks, 4 up by 1 of 4 and 4 down by 1 of 4 (mean 0, a CI across zero); the whole split
    # moves by (8 x 0.5 + 0) / 16 = +0.25.
    def record(rows):
        return {**summarize(rows, [1, 4], 4).to_dict(), "phase": "sft", "step": 0}

    lib_b, lib_a = _per_task([0] * 8, prefix="l"), _per_task([2] * 8, prefix="l")
    he_b, he_a = _per_task([2] * 8, prefix="h"), _per_task([3, 1] * 4, prefix="h")
    for rows, src in ((lib_b, "lib"), (lib_a, "lib"), (he_b, "he"), (he_a, "he")):
        for r in rows:
            r["source"] = src
    start = record(lib_b + he_b)
    last = {**record(lib_a + he_a), "phase": None, "step": 6}
    split = families(last)
    assert list(split) == ["lib", "he"]  # order of first appearance
    assert split["lib"]["pass_at"]["1"]["mean"] == 0.5 and len(split["he"]["per_task"]) == 8
    rows = dict(summary_lines([start, last]))
    assert rows["RL only: pass@1 change (paired, 95% CI)"].startswith("+0.250")
    assert rows["lib: RL only pass@1 change (paired, 95% CI)"] == (
        "+0.500 [+0.500, +0.500] (excludes zero)"
    )
    he = rows["he: RL only pass@1 change (paired, 95% CI)"]
    assert he.startswith("+0.000") and he.endswith("(includes zero)")
    assert rows["lib (8 tasks): pass@1 / pass@4 before -> after RL"] == (
        "0.000 [0.000, 0.000] -> 0.500 [0.500, 0.500]; pass@4 0.000 [0.000, 0.000] -> "
        "1.000 [1.000, 1.000]"
    )
    for r in lib_b + he_b + lib_a + he_a:  # records before `source`: no split
        r.pop("source")
    start, last = record(lib_b + he_b), {**record(lib_a + he_a), "phase": None, "step": 6}
    assert families(last) == {} and not any("lib" in k for k in dict(summary_lines([start, last])))


def test_evaluate_counts_broken_calls_per_episode_and_episodes_with_one():
    class Broken(_ScriptedEnvironment):
        def rollout(self, policy, tasks, params, group_size):
            eps = super().rollout(policy, tasks, params, group_size)
            for i, ep in enumerate(eps):
                ep.broken_tool_calls = [0, 3, 1, 0, 0, 0][i]
            return eps

    res = _evaluate(Broken(OUTCOMES))  # 6 episodes, 4 broken calls in 2 of them
    assert res.broken_calls == pytest.approx(4 / 6)
    assert res.broken_episode_rate == pytest.approx(2 / 6)
    assert res.per_task[0]["broken_calls"] == 3 and res.per_task[0]["broken_episodes"] == 1


def test_an_episode_the_harness_failed_as_infrastructure_is_counted_masked_not_measured():
    """A prompt that never fit the context window (the harness raises before sampling: the
    episode ends ``error``, ``failure="infra"``) is no measurement: evaluation counts it with
    the grading errors, names why, and an evaluation of nothing but such episodes fails, with
    the hint to raise the window (it used to print 0.000 with no error counted)."""
    from coderl.eval.passk import check_measured
    from coderl.stats import NothingMeasured

    reason = "ValueError: a fresh context window (2128 tokens) plus one turn (64) exceeds context_budget=2048"

    class TooLong(_ScriptedEnvironment):
        def rollout(self, policy, tasks, params, group_size):
            eps = super().rollout(policy, tasks, params, group_size)
            for ep in eps:
                ep.finish_reason, ep.failure, ep.failure_reason = "error", "infra", reason
            return eps

    res = _evaluate(TooLong({t: [False, False] for t in OUTCOMES}))
    assert res.grading_errors == 6 and res.grading_error_examples == [f"episode error: {reason}"]
    with pytest.raises(NothingMeasured, match="raise rollout.max_context_tokens"):
        check_measured(res.to_dict())
    assert _evaluate(_ScriptedEnvironment(OUTCOMES)).grading_errors == 0


def test_paired_change_pairs_evaluations_with_different_n():
    from coderl.eval.passk import compare

    # the base model once per task, the final policy 4 times: per-task pass@1 estimates 0 or 1
    # against c/4; the largest common k is 1
    base = {"per_task": _per_task([0, 1, 0, 0], n=1)}
    final = {"per_task": _per_task([2, 4, 1, 0])}
    c = compare(base, final)
    assert c.k == 1
    assert c.pass1.mean == pytest.approx(((0.5 - 0) + (1 - 1) + (0.25 - 0) + 0) / 4)


def test_compare_pairs_the_broken_call_rate_by_task():
    from coderl.eval.passk import compare

    def side(broken, order=1):
        rows = [
            {"task_id": f"t{i}", "n": 4, "correct": 0, "best": 0.0, "episodes": 4,
             "broken_calls": b, "broken_episodes": min(b, 4)}
            for i, b in enumerate(broken)
        ]  # fmt: skip
        return {"per_task": rows[::order]}

    # every task loses 4 broken calls in 4 episodes: -1 per episode, the CI a point
    c = compare(side([6, 4, 8, 5]), side([2, 0, 4, 1], order=-1))  # listed in reverse: by id
    assert (c.broken_change.mean, c.broken_change.lo, c.broken_change.hi) == (-1.0, -1.0, -1.0)
    # one task improves, one gets worse: the CI spans zero
    c = compare(side([4, 0, 0, 0]), side([0, 4, 0, 0]))
    assert c.broken_change.mean == 0.0 and c.broken_change.lo < 0 < c.broken_change.hi
    # records without per-task episode counts (older eval.jsonl): no paired change
    old = {"per_task": [{"task_id": "t0", "n": 4, "correct": 0, "best": 0.0}]}
    assert compare(old, old).broken_change is None


def test_pooled_change_averages_each_tasks_change_over_runs_and_pairs_by_id():
    from coderl.eval.passk import paired_change, pooled_change

    # Run 1 gains on tasks 0-19 (+0.25 each), run 2 on none: pooled = half of run 1's change.
    r1 = (_per_task([0] * 64), _per_task([1] * 20 + [0] * 44))
    r2 = (_per_task([0] * 64), _per_task([0] * 64)[::-1])  # listed in another order
    one = paired_change(*r1)
    both = pooled_change([r1, r2])
    assert both.mean == pytest.approx(one.mean / 2)
    assert 0 < both.lo < both.mean < both.hi < one.hi
    assert pooled_change([r1]) == one  # one run: the run's own paired change
    with pytest.raises(ValueError, match="other tasks than run 0"):
        pooled_change([r1, (_per_task([0] * 64, prefix="u"), _per_task([0] * 64, prefix="u"))])
    with pytest.raises(ValueError, match="same distinct tasks"):
        pooled_change([r1, (r2[0], r2[1][:10])])
    with pytest.raises(ValueError, match="at least one run"):
        pooled_change([])
