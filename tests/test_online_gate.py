"""Monitors, alarms, the eval gate and the checkpoint registry's atomic champion pointer."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from coderl.config.online import GateConfig
from coderl.online.events import parse_event
from coderl.online.gate import paired_noninferiority, run_gate
from coderl.online.monitors import AlarmRule, check_alarms, monitor_snapshot
from coderl.online.registry import Registry
from coderl.online.rewards import RewardSpec, finalize
from coderl.online.store import Store, interaction_row
from coderl.stats import (
    newcombe_paired_lower,
    paired_binary_lower,
    score_resolution,
    student_t_cdf,
    student_t_quantile,
    tango_paired_lower,
    wilson_interval,
)

T0 = 1_000_000.0


def _traffic(store: Store, version: int, n: int, edit_every: int, accept: bool) -> None:
    """n interactions of ``version``: every ``edit_every``-th edits (accepted or not), the
    others ask a clarifying question."""
    for i in range(n):
        iid = f"v{version}-{i}"
        edit = i % edit_every == 0
        store.record_interaction(
            interaction_row(
                iid,
                policy_version=version,
                created_at=T0 + version * 100 + i,
                prompt_token_ids=[1],
                completion_token_ids=[2, 3],
                behaviour_logprobs=[-1.0, -1.0],
                temperature=1.0,
                action="edit" if edit else "clarify",
            )
        )
        if edit:
            store.ingest(
                [
                    parse_event(
                        {
                            "event_id": f"e-{iid}",
                            "interaction_id": iid,
                            "type": "accepted" if accept else "rejected",
                        }
                    )
                ],
                now=T0 + version * 100 + i + 1,  # the server receives it after the interaction
            )


def test_edit_rate_collapse_while_reward_rises_blocks_promotion(tmp_path: Path) -> None:
    store = Store(f"sqlite:///{tmp_path / 'm.db'}")
    # spec where asking is cheap (deferral -0.6 <= worst edit -0.6): the hack is to stop editing
    spec = RewardSpec(
        accept=0.5, persist=0.0, follow_up=0.0, latency=0.1, deferral=-0.6, broken_tool_call=-1.0
    )
    _traffic(store, 0, 40, edit_every=1, accept=False)  # champion: edits always, all rejected
    _traffic(store, 1, 40, edit_every=4, accept=False)  # candidate: edits 1 in 4
    finalize(store, spec, now=T0 + 10_000)
    snap = monitor_snapshot(store, "v1", window_s=1e6, now=T0 + 10_000)
    champ, cand = snap["by_version"][0]["*"], snap["by_version"][1]["*"]
    # champion: reward -0.5 on every turn; candidate: 10 x -0.5 + 30 x -0.6 -> -0.575: reward fell
    assert champ["edit_rate"] == 1.0 and cand["edit_rate"] == 0.25
    assert cand["clarify_rate"] == 0.75
    rules = [
        AlarmRule(metric="edit_rate", direction="drop", threshold=0.1, only_if_reward_rises=True)
    ]
    assert check_alarms(snap["by_version"][0], snap["by_version"][1], rules) == []
    # now the hack pays: the candidate's edits are accepted -> reward rises as edits collapse
    store2 = Store(f"sqlite:///{tmp_path / 'm2.db'}")
    _traffic(store2, 0, 40, edit_every=1, accept=False)
    _traffic(store2, 1, 40, edit_every=4, accept=True)
    finalize(store2, spec, now=T0 + 10_000)
    snap2 = monitor_snapshot(store2, "v1", window_s=1e6, now=T0 + 10_000)
    # candidate: 10 x +0.5 + 30 x -0.6 = -13 / 40 = -0.325 > -0.5
    assert snap2["by_version"][1]["*"]["reward"] == pytest.approx(-0.325)
    alarms = check_alarms(snap2["by_version"][0], snap2["by_version"][1], rules)
    assert sorted(a.population for a in alarms) == ["*", "default"]
    # held-out: 10 tasks solved by both, no discordant task: bound -z^2 / (10 + z^2) =
    # -2.70554 / 12.70554 = -0.213 > -0.25, so only the alarm can block
    ok = ([1.0] * 10, [1.0] * 10)
    report = run_gate(GateConfig(margins={"pass@1": 0.25}), {"pass@1": ok}, None, alarms)
    assert not report.promote and report.comparisons[0].passed
    assert (
        "edit_rate drop 1.000 -> 0.250" in report.reasons[0] and "reward rose" in report.reasons[0]
    )


def test_behaviour_check_on_heldout_blocks_promotion() -> None:
    champ = {"n": 20, "edit_rate": 0.9, "clarify_rate": 0.05, "reward": 0.1}
    cand = {"n": 20, "edit_rate": 0.4, "clarify_rate": 0.5, "reward": 0.3}
    # 20 tied tasks: held-out bound -2.70554 / 22.70554 = -0.119 > -0.15 passes
    cfg = GateConfig(margins={"pass@1": 0.15})
    report = run_gate(cfg, {"pass@1": ([1.0] * 20, [1.0] * 20)}, (champ, cand), [])
    assert not report.promote and report.comparisons[0].passed
    assert {r.split()[1] for r in report.reasons} == {"edit_rate", "clarify_rate"}


def test_student_t_distribution_matches_closed_forms_and_tables() -> None:
    # df = 1 is the Cauchy distribution: P(T <= t) = 1/2 + atan(t) / pi; P(T <= 1) = 0.75
    assert student_t_cdf(1.0, 1) == pytest.approx(0.75, abs=1e-12)
    # df = 2: P(T <= t) = 1/2 + t / (2 sqrt(2 + t^2)); t = 1: 0.5 + 1 / (2 sqrt 3) = 0.7886751
    assert student_t_cdf(1.0, 2) == pytest.approx(0.5 + 1 / (2 * math.sqrt(3)), abs=1e-12)
    assert student_t_cdf(-1.3, 7) == pytest.approx(1 - student_t_cdf(1.3, 7), abs=1e-12)
    # one-sided 95 % quantiles as printed in t tables; df = 1: tan(0.45 pi) = 6.3138
    table = {1: 6.3138, 2: 2.9200, 3: 2.3534, 4: 2.1318, 9: 1.8331, 40: 1.6839}
    for df, q in table.items():
        assert student_t_quantile(0.95, df) == pytest.approx(q, abs=1e-4)
    assert student_t_quantile(0.975, 1) == pytest.approx(math.tan(0.475 * math.pi), rel=1e-9)
    # large df: t = z + (z^3 + z) / (4 df) + O(df^-2) with z = z_0.95 = 1.6448536;
    # df = 2000: 1.6448536 + (4.4502 + 1.6449) / 8000 = 1.6456155
    z = 1.6448536
    assert student_t_quantile(0.95, 2000) == pytest.approx(z + (z**3 + z) / 8000, abs=1e-6)
    with pytest.raises(ValueError, match="df >= 1"):
        student_t_cdf(1.0, 0)
    with pytest.raises(ValueError, match=r"\[0.5, 1\)"):
        student_t_quantile(1.0, 3)


def test_paired_noninferiority_hand_worked() -> None:
    # pass rates over 4 samples, d = [0.25, -0.5, 0, 0]: mean -0.0625, squared deviations
    # 0.3125^2 + 0.4375^2 + 2 * 0.0625^2 = 0.296875, sd = sqrt(0.296875 / 3) = 0.314576,
    # se = 0.314576 / 2 = 0.157288; t_{0.95, 3} = 2.353363 -> lower = -0.0625 - 0.370156 =
    # -0.432656 > -0.45. Floor 0.25 / sqrt(4) = 0.125 < sd: not used.
    cand, champ = [0.75, 0.25, 1.0, 0.5], [0.5, 0.75, 1.0, 0.5]
    c = paired_noninferiority("pass@1", cand, champ, margin=0.45, alpha=0.05)
    assert c.method == "student-t" and c.diff_mean == -0.0625
    assert c.diff_sd == pytest.approx(0.314576, abs=1e-6) and c.sd_floor == 0.125
    assert c.quantile == pytest.approx(2.353363, abs=1e-6)
    assert c.lower_bound == pytest.approx(-0.432656, abs=1e-6) and c.passed
    # margin 0.4 passed under the old normal bound (-0.0625 - 1.645 * 0.157288 = -0.3212)
    assert not paired_noninferiority("pass@1", cand, champ, margin=0.4, alpha=0.05).passed
    # pass rates over 4 samples: d = [0.25, 0, -0.25]: mean 0, sd = sqrt(2 * 0.0625 / 2) = 0.25,
    # se = 0.25 / sqrt(3) = 0.1443376; t_{0.95, 2} = 2.919986 -> lower = -0.421464
    c = paired_noninferiority("pass@1", [0.5, 1.0, 0.75], [0.25, 1.0, 1.0], margin=0.45, alpha=0.05)
    assert c.lower_bound == pytest.approx(-0.421464, abs=2e-6) and c.passed
    # alpha = 0.025 (97.5 %): t_{0.975, 2} = 4.302653 -> lower = -0.621035 < -0.45
    c = paired_noninferiority(
        "pass@1", [0.5, 1.0, 0.75], [0.25, 1.0, 1.0], margin=0.45, alpha=0.025
    )
    assert c.lower_bound == pytest.approx(-0.621035, abs=2e-6) and not c.passed


def test_five_tasks_the_normal_bound_would_promote_the_t_bound_does_not() -> None:
    # pass rates over 2 samples, candidate [0.5, 0, 0.5, 0.5, 0] vs champion
    # [0, 0, 0.5, 0.5, 0.5]: d = [0.5, 0, 0, 0, -0.5], mean 0, sd = sqrt(0.5 / 4) = 0.3535534,
    # se = 0.3535534 / sqrt(5) = 0.1581139.
    # normal bound: 0 - 1.645 * 0.1581139 = -0.260 > -0.3 (the gate before the t bound promoted);
    # t bound: 0 - t_{0.95, 4} * se = -2.131847 * 0.1581139 = -0.337075 <= -0.3: rejected
    cand, champ = [0.5, 0.0, 0.5, 0.5, 0.0], [0.0, 0.0, 0.5, 0.5, 0.5]
    assert 0.0 - 1.645 * math.sqrt(0.125) / math.sqrt(5) > -0.3
    c = paired_noninferiority("pass@1", cand, champ, margin=0.3, alpha=0.05)
    assert c.method == "student-t" and c.sd_floor == pytest.approx(0.5 / math.sqrt(5))
    assert c.lower_bound == pytest.approx(-0.337075, abs=2e-6) and not c.passed
    report = run_gate(GateConfig(margins={"pass@1": 0.3}), {"pass@1": (cand, champ)}, None, [])
    assert not report.promote
    assert (
        "lower bound of the paired difference -0.337 <= -margin -0.300 (n=5)" in (report.reasons[0])
    )


Z95 = 1.6448536269514715  # z_{0.95}; z^2 = 2.7055435


def test_wilson_and_newcombe_method_10_hand_worked() -> None:
    # table a=4 (both pass), b=3 (candidate only), c=1 (champion only), d=2; n=10:
    # p1 = 7/10 = 0.7, p2 = 5/10 = 0.5, estimate 0.2.
    # Wilson (2x + z^2 -+ z sqrt(z^2 + 4x(n-x)/n)) / (2(n + z^2)), 2(n + z^2) = 25.411087:
    #   x=7: sqrt(2.7055435 + 8.4) = 3.3324981, * z = 5.4814716 ->
    #        l1 = (14 + 2.7055435 - 5.4814716) / 25.411087 = 0.4416998
    #   x=5: sqrt(2.7055435 + 10) = 3.5644836, * z = 5.8630538 ->
    #        u2 = (10 + 2.7055435 + 5.8630538) / 25.411087 = 0.7307282
    # phi = (4*2 - 3*1) / sqrt(7*3*5*5) = 5 / sqrt(525) = 0.2182179
    # dl = 0.7 - 0.4416998 = 0.2583002, du = 0.7307282 - 0.5 = 0.2307282
    # delta^2 = 0.0667190 - 2 * 0.2182179 * 0.2583002 * 0.2307282 + 0.0532355 = 0.0939442
    # delta = 0.3065031 -> L = 0.2 - 0.3065031 = -0.1065031
    assert wilson_interval(7, 10, Z95)[0] == pytest.approx(0.4416998, abs=1e-7)
    assert wilson_interval(5, 10, Z95)[1] == pytest.approx(0.7307282, abs=1e-7)
    assert newcombe_paired_lower(4, 3, 1, 2, Z95) == pytest.approx(-0.1065031, abs=1e-7)
    # through the gate: the candidate's and champion's scores in task order
    cand = [1.0] * 4 + [1.0] * 3 + [0.0] * 1 + [0.0] * 2
    champ = [1.0] * 4 + [0.0] * 3 + [1.0] * 1 + [0.0] * 2
    c = paired_noninferiority("pass@1", cand, champ, margin=0.2, alpha=0.05)
    assert c.method == "paired-binary" and c.quantile == pytest.approx(Z95, abs=1e-12)
    assert c.bounds["newcombe10"] == pytest.approx(-0.1065031, abs=1e-7)
    assert c.lower_bound == min(c.bounds.values()) and c.passed


def _tango_score(a: int, b: int, c: int, d: int, diff: float) -> float:
    """Tango's score statistic written out again (restricted MLE of the c-cell probability,
    then (b - c - n D) / sqrt(n (2 q + D (1 - D))))."""
    n = a + b + c + d
    bq = -b - c + (2 * n - b + c) * diff
    cq = -c * diff * (1 - diff)
    q = (math.sqrt(bq * bq - 4 * (2 * n) * cq) - bq) / (2 * (2 * n))
    return (b - c - n * diff) / math.sqrt(n * (2 * q + diff * (1 - diff)))


def test_tango_bound_solves_its_score_equation() -> None:
    # the lower bound L is where the one-sided score test stops rejecting: Z(L) = z
    for table in [(4, 3, 1, 2), (6, 8, 0, 6), (0, 1, 4, 0), (10, 2, 5, 3), (1, 1, 7, 12)]:
        lower = tango_paired_lower(*table, Z95)
        assert lower < (table[1] - table[2]) / sum(table)
        assert _tango_score(*table, lower) == pytest.approx(Z95, abs=1e-6)
    # no discordant task: q = -D for D < 0, so Z(D) = sqrt(n |D| / (1 - |D|)) = z at
    # |D| = z^2 / (n + z^2); n = 6: 2.7055435 / 8.7055435 = 0.3107840, whatever a and d are
    for a in range(7):
        assert tango_paired_lower(a, 0, 0, 6 - a, Z95) == pytest.approx(-0.3107840, abs=1e-7)
    assert tango_paired_lower(0, 0, 5, 0, Z95) == -1.0  # champion-only on every task


def test_tied_binary_tasks_no_longer_promote_at_a_small_margin() -> None:
    # 5 tasks, no discordant one; the t bound was 0 (sd(d) = 0) and promoted at any margin
    for cand, champ in [([1.0] * 5, [1.0] * 5), ([0.0] * 5, [0.0] * 5)]:
        c = paired_noninferiority("pass@1", cand, champ, margin=0.05, alpha=0.05)
        # Newcombe: phi = 0 (a margin of 0 or 5), delta = u2 - p2 (or p1 - l1) =
        # z^2 / (5 + z^2) = 2.7055435 / 7.7055435 = 0.3511165; Tango the same (see above)
        assert c.bounds["newcombe10"] == pytest.approx(-0.3511165, abs=1e-7)
        assert c.lower_bound == pytest.approx(-0.3511165, abs=1e-7) and not c.passed
    report = run_gate(GateConfig(), {"pass@1": ([1.0] * 5, [1.0] * 5)}, None, [])
    assert not report.promote and "-0.351 <= -margin -0.050 (n=5)" in report.reasons[0]
    # 6 tasks, 3 solved by both and 3 by neither: Newcombe's method 10 alone collapses. phi =
    # (3*3) / sqrt(3*3*3*3) = 1 and the Wilson interval of 3/6 is symmetric about 0.5
    # (0.2212600, 0.7787400), so delta = |0.2787400 - 0.2787400| = 0 and its bound is 0; the
    # gate takes Tango's -z^2 / (6 + z^2) = -0.3107840 instead
    cand = champ = [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    c = paired_noninferiority("pass@1", cand, champ, margin=0.05, alpha=0.05)
    assert c.bounds["newcombe10"] == pytest.approx(0.0, abs=1e-12)
    assert c.lower_bound == pytest.approx(-0.3107840, abs=1e-7) and not c.passed


def test_clear_binary_win_promotes() -> None:
    # 20 tasks: 6 solved by both, 8 by the candidate only, 0 by the champion only, 6 by neither;
    # estimate +0.4. Newcombe: p1 = 0.7, p2 = 0.3; Wilson(14/20) lower: 2(n + z^2) = 45.411087,
    # sqrt(2.7055435 + 4*14*6/20) = 4.4165081, * z = 7.2645093 -> (28 + 2.7055435 - 7.2645093)
    # / 45.411087 = 0.5161963; Wilson(6/20) upper is its mirror 0.4838037; dl = du = 0.1838037,
    # phi = (6*6 - 0) / sqrt(14*6*6*14) = 36 / 84 = 0.4285714,
    # delta = 0.1838037 * sqrt(2 - 2 * 0.4285714) = 0.1838037 * 1.0690450 = 0.1964944,
    # L = 0.4 - 0.1964944 = 0.2035056 > 0: better than the champion, not just non-inferior
    cand = [1.0] * 6 + [1.0] * 8 + [0.0] * 6
    champ = [1.0] * 6 + [0.0] * 8 + [0.0] * 6
    assert wilson_interval(14, 20, Z95)[0] == pytest.approx(0.5161963, abs=1e-7)
    c = paired_noninferiority("pass@1", cand, champ, margin=0.05, alpha=0.05)
    assert c.bounds["newcombe10"] == pytest.approx(0.2035056, abs=1e-7)
    assert c.lower_bound > 0 and c.passed
    assert run_gate(GateConfig(), {"pass@1": (cand, champ)}, None, []).promote


def test_tied_pass_rates_get_the_resolution_floor() -> None:
    # 4 samples per task (grid step 1/4), 5 tasks, every difference 0: sd(d) = 0 and the bound
    # was 0; the floor is sd = 0.25 / sqrt(5) -> lower = -t_{0.95, 4} * 0.25 / 5 =
    # -2.131847 * 0.05 = -0.1065923 <= -0.05: not promoted
    rates = [0.75, 1.0, 0.5, 1.0, 0.25]
    c = paired_noninferiority("pass@1", rates, rates, margin=0.05, alpha=0.05)
    assert c.method == "student-t" and c.diff_sd == 0.0
    assert c.lower_bound == pytest.approx(-0.1065923, abs=1e-7) and not c.passed
    # the documented limit: the floor shrinks as 1/n; at 15 tied tasks it is -t_{0.95, 14} *
    # 0.25 / 15 = -1.761310 / 60 = -0.0293552 > -0.05, and the gate promotes
    c = paired_noninferiority("pass@1", rates * 3, rates * 3, margin=0.05, alpha=0.05)
    assert c.lower_bound == pytest.approx(-0.0293552, abs=1e-7) and c.passed


def test_score_resolution_is_the_coarsest_fitting_grid() -> None:
    assert score_resolution([0.0, 1.0]) == 1.0
    assert score_resolution([0.25, 0.5, 1.0]) == 0.25
    assert score_resolution([0.0, 0.5, 1.0]) == 0.5  # 4 samples giving 0, 2 or 4 passes
    assert score_resolution([1 / 3, 2 / 3]) == pytest.approx(1 / 3)
    assert score_resolution([math.pi / 10]) is None


def test_paired_noninferiority_rejects_bad_input_clearly() -> None:
    with pytest.raises(ValueError, match="at least 2 tasks; got 0 candidate and 0 champion"):
        paired_noninferiority("pass@1", [], [], margin=0.1, alpha=0.05)
    with pytest.raises(ValueError, match="got 1 candidate and 2 champion"):
        paired_noninferiority("pass@1", [1.0], [1.0, 0.0], margin=0.1, alpha=0.05)
    with pytest.raises(ValueError, match="at least 2 tasks; got 1 candidate"):
        paired_noninferiority("pass@1", [1.0], [0.0], margin=0.1, alpha=0.05)
    with pytest.raises(ValueError, match="finite"):
        paired_noninferiority("pass@1", [1.0, math.nan], [0.0, 1.0], margin=0.1, alpha=0.05)
    with pytest.raises(ValueError, match="finite"):
        paired_noninferiority("pass@1", [1.0, 0.0], [0.0, -math.inf], margin=0.1, alpha=0.05)
    with pytest.raises(ValueError, match="0 < alpha < 0.5"):
        paired_noninferiority("pass@1", [1.0, 0.0], [0.0, 1.0], margin=0.1, alpha=0.5)
    with pytest.raises(ValueError, match="margin >= 0"):
        paired_noninferiority("pass@1", [1.0, 0.0], [0.0, 1.0], margin=-0.1, alpha=0.05)
    with pytest.raises(ValueError, match="non-empty table"):
        tango_paired_lower(0, 0, 0, 0, 1.645)
    with pytest.raises(ValueError, match="non-empty table"):
        newcombe_paired_lower(1, -1, 0, 0, 1.645)
    with pytest.raises(ValueError, match="0 <= successes <= n"):
        wilson_interval(3, 2, 1.645)
    with pytest.raises(ValueError, match="scores of 0 or 1"):
        paired_binary_lower([1.0, 0.5], [1.0, 1.0], 1.645)


def test_candidate_breaching_a_heldout_margin_is_rejected_and_champion_stays(
    tmp_path: Path,
) -> None:
    reg = Registry(tmp_path / "reg")
    v0 = reg.new_version(parent=None)
    reg.init_champion(v0)
    v1 = reg.new_version(parent=v0, info={"train_reward_before": -0.4, "train_reward": 0.6})
    champ = [1.0] * 8 + [0.0] * 2  # pass@1 0.8
    cand = [1.0] * 4 + [0.0] * 6  # 0.4, although the training reward rose (4 tasks lost)
    report = run_gate(GateConfig(margins={"pass@1": 0.05}), {"pass@1": (cand, champ)}, None, [])
    assert not report.promote and report.reasons[0].startswith("held-out pass@1")
    reg.reject(v1, report.to_dict())
    assert reg.champion() == v0
    assert reg.meta(v1)["status"] == "rejected"
    assert reg.meta(v1)["gate_report"]["comparisons"][0]["candidate_mean"] == pytest.approx(0.4)
    with pytest.raises(ValueError, match="missing for gated metrics \\['pass@1'\\]"):
        run_gate(GateConfig(), {"other": (cand, champ)}, None, [])


def test_promotion_updates_pointer_and_lineage(tmp_path: Path) -> None:
    reg = Registry(tmp_path / "reg")
    v0 = reg.new_version(parent=None)
    reg.init_champion(v0)
    v1 = reg.new_version(parent=v0)
    reg.promote(v1, {"promote": True})
    v2 = reg.new_version(parent=v1)
    assert reg.champion() == v1 and reg.lineage(v2) == [2, 1, 0] and reg.promoted() == [0, 1]
    with pytest.raises(RuntimeError, match="already has champion"):
        reg.init_champion(v2)


_CRASHER = """
import os, signal, sys
from coderl.online.registry import Registry
reg = Registry(sys.argv[1])
point = sys.argv[2]
real_replace, real_fsync = os.replace, os.fsync
def die():
    os.kill(os.getpid(), signal.SIGKILL)
def replace(a, b):
    if str(b).endswith("CHAMPION"):
        if point == "before_swap":
            die()
        real_replace(a, b)
        if point == "after_swap":
            die()
    else:
        real_replace(a, b)
def fsync(fd):
    real_fsync(fd)
    if point == "tmp_written" and os.readlink(f"/proc/self/fd/{fd}").find("CHAMPION.tmp") >= 0:
        die()
os.replace, os.fsync = replace, fsync
reg.promote(int(sys.argv[3]), {"promote": True})
"""


@pytest.mark.parametrize(
    "point,expected", [("tmp_written", 0), ("before_swap", 0), ("after_swap", 1)]
)
def test_crash_mid_promotion_leaves_exactly_one_champion(
    tmp_path: Path, point: str, expected: int
) -> None:
    reg = Registry(tmp_path / "reg")
    reg.init_champion(reg.new_version(parent=None))
    v1 = reg.new_version(parent=0)
    r = subprocess.run(
        [sys.executable, "-c", _CRASHER, str(tmp_path / "reg"), point, str(v1)],
        env={**os.environ, "PYTHONPATH": str(Path.cwd())},
    )
    assert r.returncode == -9  # really killed mid-promotion
    reg2 = Registry(tmp_path / "reg")  # reopen: recovers
    pointers = [p for p in (tmp_path / "reg").iterdir() if p.name.startswith("CHAMPION")]
    assert [p.name for p in pointers] == ["CHAMPION"]  # the stale temp file is gone
    assert reg2.champion() == expected
    assert reg2.promoted()[-1] == expected


def test_live_alarm_on_the_champion_blocks_the_next_promotion(tmp_path: Path) -> None:
    """The cycle's monitor path: the champion (v1) edits far less than its predecessor (v0)
    while its reward rose -> an alarm, which the gate turns into a rejection."""
    from coderl.config import load_online_config
    from coderl.online.cycle import open_run, production_alarms

    cfg = load_online_config(
        "configs/online-demo.yaml",
        [
            f"run_dir={tmp_path}",
            "online.monitors.min_samples=20",
            "online.monitors.window_s=1e7",
            "online.reward.deferral=-0.6",
            "online.reward.accept=0.5",
            "online.reward.persist=0",
            "online.reward.follow_up=0",
            "online.reward.latency=0.1",
            "online.reward.broken_tool_call=-1",
        ],
    )
    store, registry = open_run(cfg)
    registry.promote(registry.new_version(parent=0), {"promote": True})
    _traffic(store, 0, 40, edit_every=1, accept=False)
    _traffic(store, 1, 40, edit_every=4, accept=True)
    finalize(store, cfg.online.reward, now=T0 + 10_000)
    alarms, snap = production_alarms(cfg, store, registry, T0 + 10_000)
    assert snap["by_version"][1]["*"]["edit_rate"] == 0.25
    reasons = {a.reason().split(" [")[0] for a in alarms}
    assert "alarm: edit_rate drop 1.000 -> 0.250 (threshold 0.1) while reward rose" in reasons
    # 5 tied tasks: held-out bound -2.70554 / 7.70554 = -0.351 > -0.4; the alarm alone blocks
    gate = cfg.online.gate.model_copy(update={"margins": {"pass@1": 0.4}})
    report = run_gate(gate, {"pass@1": ([1.0] * 5, [1.0] * 5)}, None, alarms)
    assert not report.promote and report.comparisons[0].passed
    assert report.reasons == report.alarms


def test_a_rise_in_the_suspected_hack_rate_blocks_promotion() -> None:
    ok = {"pass@1": ([1.0] * 60, [1.0] * 60)}  # held-out ties: non-inferior at 0.05 on 60 tasks
    cfg = GateConfig(hack_rate_margin=0.05)
    assert run_gate(cfg, ok, None, []).promote
    assert run_gate(cfg, ok, None, [], hack_rates=(0.10, 0.14)).promote  # within the margin
    assert run_gate(cfg, ok, None, [], hack_rates=(0.30, 0.0)).promote  # a drop is welcome
    report = run_gate(cfg, ok, None, [], hack_rates=(0.10, 0.20))
    assert not report.promote and report.comparisons[0].passed
    assert (
        report.alarms
        == report.reasons
        == ["alarm: suspected_hack_rate rise 0.100 -> 0.200 (threshold 0.05) [population heldout]"]
    )
    # the default margin is 0: any rise blocks
    assert not run_gate(GateConfig(), ok, None, [], hack_rates=(0.0, 0.01)).promote
    with pytest.raises(ValueError, match="hack rates must be in"):
        run_gate(cfg, ok, None, [], hack_rates=(0.0, math.nan))
