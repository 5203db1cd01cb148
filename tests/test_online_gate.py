"""Monitors, alarms, the eval gate and the checkpoint registry's atomic champion pointer."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from coderl.online.events import parse_event
from coderl.online.gate import (
    GateConfig,
    paired_noninferiority,
    run_gate,
    student_t_cdf,
    student_t_quantile,
)
from coderl.online.monitors import AlarmRule, check_alarms, monitor_snapshot
from coderl.online.registry import Registry
from coderl.online.rewards import RewardSpec, finalize
from coderl.online.store import Store, interaction_row

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
                now=T0,
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
    ok = ([1.0] * 10, [1.0] * 10)
    report = run_gate(GateConfig(), {"pass@1": ok}, None, alarms)
    assert not report.promote
    assert (
        "edit_rate drop 1.000 -> 0.250" in report.reasons[0] and "reward rose" in report.reasons[0]
    )


def test_behaviour_check_on_heldout_blocks_promotion() -> None:
    champ = {"n": 20, "edit_rate": 0.9, "clarify_rate": 0.05, "reward": 0.1}
    cand = {"n": 20, "edit_rate": 0.4, "clarify_rate": 0.5, "reward": 0.3}
    report = run_gate(GateConfig(), {"pass@1": ([1.0] * 20, [1.0] * 20)}, (champ, cand), [])
    assert not report.promote
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
    # d = [0, -1, 0, 0]: mean -0.25, sd = sqrt((3 * 0.0625 + 0.5625) / 3) = 0.5, se = 0.5/2 =
    # 0.25; t_{0.95, 3} = 2.35336 -> lower = -0.25 - 2.35336 * 0.25 = -0.83834
    c = paired_noninferiority("pass@1", [1, 0, 1, 0], [1, 1, 1, 0], margin=0.85, alpha=0.05)
    assert c.diff_mean == -0.25 and c.diff_sd == pytest.approx(0.5)
    assert c.t_quantile == pytest.approx(2.35336, abs=1e-5)
    assert c.lower_bound == pytest.approx(-0.83834, abs=1e-5) and c.passed
    # margin 0.7 passed under the old normal bound (-0.25 - 1.645 * 0.25 = -0.66125); not now
    c = paired_noninferiority("pass@1", [1, 0, 1, 0], [1, 1, 1, 0], margin=0.7, alpha=0.05)
    assert not c.passed
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
    # candidate [1, 0, 1, 1, 0] vs champion [0, 0, 1, 1, 1]: d = [1, 0, 0, 0, -1], mean 0,
    # sd = sqrt(2 / 4) = 0.7071068, se = 0.7071068 / sqrt(5) = 0.3162278.
    # normal bound: 0 - 1.645 * 0.3162278 = -0.520 > -0.6 (the old gate promoted);
    # t bound: 0 - t_{0.95, 4} * se = -2.131847 * 0.3162278 = -0.674149 <= -0.6: rejected
    cand, champ = [1.0, 0.0, 1.0, 1.0, 0.0], [0.0, 0.0, 1.0, 1.0, 1.0]
    assert 0.0 - 1.645 * math.sqrt(0.5) / math.sqrt(5) > -0.6
    c = paired_noninferiority("pass@1", cand, champ, margin=0.6, alpha=0.05)
    assert c.lower_bound == pytest.approx(-0.674149, abs=2e-6) and not c.passed
    report = run_gate(GateConfig(margins={"pass@1": 0.6}), {"pass@1": (cand, champ)}, None, [])
    assert not report.promote
    assert (
        "lower bound of the paired difference -0.674 <= -margin -0.600 (n=5)" in (report.reasons[0])
    )


def test_paired_noninferiority_rejects_bad_input_clearly() -> None:
    with pytest.raises(ValueError, match="at least 2 tasks; got 0 candidate and 0 champion"):
        paired_noninferiority("pass@1", [], [], margin=0.1, alpha=0.05)
    with pytest.raises(ValueError, match="got 1 candidate and 2 champion"):
        paired_noninferiority("pass@1", [1.0], [1.0, 0.0], margin=0.1, alpha=0.05)
    with pytest.raises(ValueError, match="at least 2 tasks; got 1 candidate"):
        paired_noninferiority("pass@1", [1.0], [0.0], margin=0.1, alpha=0.05)
    with pytest.raises(ValueError, match="finite"):
        paired_noninferiority("pass@1", [1.0, math.nan], [0.0, 1.0], margin=0.1, alpha=0.05)
    with pytest.raises(ValueError, match="0 < alpha < 0.5"):
        paired_noninferiority("pass@1", [1.0, 0.0], [0.0, 1.0], margin=0.1, alpha=0.5)
    with pytest.raises(ValueError, match="margin >= 0"):
        paired_noninferiority("pass@1", [1.0, 0.0], [0.0, 1.0], margin=-0.1, alpha=0.05)


def test_candidate_breaching_a_heldout_margin_is_rejected_and_champion_stays(
    tmp_path: Path,
) -> None:
    reg = Registry(tmp_path / "reg")
    v0 = reg.new_version(parent=None)
    reg.init_champion(v0)
    v1 = reg.new_version(parent=v0, info={"train_reward_before": -0.4, "train_reward": 0.6})
    champ = [1.0] * 8 + [0.0] * 2  # pass@1 0.8
    cand = [1.0] * 4 + [0.0] * 6  # 0.4, although the training reward rose
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
    from coderl.online.config import load_online_config
    from coderl.online.cycle import open_run, production_alarms

    cfg = load_online_config(
        "configs/online-demo.yaml",
        [
            f"run_dir={tmp_path}",
            "monitors.min_samples=20",
            "monitors.window_s=1e7",
            "reward.deferral=-0.6",
            "reward.accept=0.5",
            "reward.persist=0",
            "reward.follow_up=0",
            "reward.latency=0.1",
            "reward.broken_tool_call=-1",
        ],
    )
    store, registry = open_run(cfg)
    registry.promote(registry.new_version(parent=0), {"promote": True})
    _traffic(store, 0, 40, edit_every=1, accept=False)
    _traffic(store, 1, 40, edit_every=4, accept=True)
    finalize(store, cfg.reward, now=T0 + 10_000)
    alarms, snap = production_alarms(cfg, store, registry, T0 + 10_000)
    assert snap["by_version"][1]["*"]["edit_rate"] == 0.25
    reasons = {a.reason().split(" [")[0] for a in alarms}
    assert "alarm: edit_rate drop 1.000 -> 0.250 (threshold 0.1) while reward rose" in reasons
    assert not run_gate(cfg.gate, {"pass@1": ([1.0] * 5, [1.0] * 5)}, None, alarms).promote
