import pytest

from coderl.eval.passk import bootstrap_ci, paired_difference, summarize


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
