"""``algorithm.advantage: vineppo`` through the trainer's advantage path (score -> turn_credit
-> make_batch), worked by hand; potential-based shaping wired into it, and its attack tests."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from coderl.config import ConfigError, load_config
from coderl.envs.base import EpisodeRecord, GradeRecord
from coderl.policy.loading import load_policy
from coderl.rewards.shaping import visible_outcomes, visible_potentials
from coderl.train import pipeline as P
from coderl.train.advantages import turn_token_advantages
from coderl.train.branching import potentials_of, turn_credit, turn_rewards
from coderl.trajectory import Segment, Trajectory

OVERRIDES = [
    "algorithm.advantage=vineppo",
    "rollout.branch.turns=[1, 2]",
    "rollout.branch.k=2",
    "rollout.group_size=3",
    "reward.terms={tests: 1.0}",
    "reward.tests=resolved",
]


class Env:
    """Grades by the answer: ``"good"`` resolves. Counts what it graded."""

    def __init__(self) -> None:
        self.graded = 0

    def grade(self, tasks, episodes):
        self.graded += len(episodes)
        return [
            GradeRecord(resolved=e.answer == "good", fraction_passed=float(e.answer == "good"))
            for e in episodes
        ]

    def ease(self, task):
        return None

    def token_budget(self):
        return 64


def segment(*turns: list[int]) -> Segment:
    """A prompt of 3 tokens, then per turn its sampled tokens and a 2-token observation."""
    seg = Segment()
    seg.append_context([5, 6, 7], "prompt")
    for t, ids in enumerate(turns):
        seg.append_sampled(ids, [-0.5] * len(ids), 0)
        seg.provenance.setdefault("actions", []).append({"turn": t, "summary": False})
        if t < len(turns) - 1:
            seg.append_context([8, 9])
    return seg


def record(answer: str, turns: int = 1, seg: Segment | None = None, **kw) -> EpisodeRecord:
    seg = seg or segment(*[[20 + t] for t in range(turns)])
    return EpisodeRecord("calc", Trajectory([seg]), "submitted", turns, answer=answer, **kw)


@pytest.fixture(scope="module")
def policy():
    return load_policy("tiny-random")


def test_three_turn_episode_gets_its_hand_worked_per_token_advantages(policy):
    cfg = load_config(None, OVERRIDES)
    seg = segment([10, 11], [12], [13, 14, 15])
    a = record("good", 3, seg)
    masked = EpisodeRecord("calc", Trajectory(), "error", 0, failure="infra", failure_reason="x")
    a.branches = [(1, record("good")), (1, record("good")), (2, record("bad")), (2, record("good")), (2, masked)]  # fmt: skip
    b, c = record("bad"), record("good")
    env = Env()
    task = SimpleNamespace(id="calc")
    scored = P.score(env, policy, cfg, [task] * 3, ["g"] * 3, [a, b, c])
    turn_adv, m = turn_credit(env, policy, cfg, scored)
    assert env.graded == 3 + 5  # every continuation graded by the same grader
    assert m["branch/continuations"] == 5 and m["branch/masked_rate"] == pytest.approx(0.2)
    # A: V(s_0) = mean(R_B, R_C) = 0.5, V(s_1) = mean(1, 1) = 1, V(s_2) = mean(0, 1) = 0.5
    # (the masked one left out); gamma 1, lam 0: A_t = V(s_{t+1}) - V(s_t), V(s_3) := R_A = 1
    #   A_0 = 1 - 0.5 = 0.5, A_1 = 0.5 - 1 = -0.5, A_2 = 1 - 0.5 = 0.5
    # B (one turn, R 0): V(s_0) = mean(1, 1) = 1 -> -1; C (R 1): V(s_0) = mean(1, 0) -> 0.5
    assert turn_adv == [pytest.approx([0.5, -0.5, 0.5]), [-1.0], [0.5]]
    trajs = [e.trajectory for e in scored.episodes]
    batch = P.make_batch(cfg, policy, None, trajs, scored.rewards.totals, scored.rewards.valid, scored.keys, turn_adv)  # fmt: skip
    assert batch is not None and batch.advantages.shape == batch.loss_mask.shape
    #            prompt    turn 0     obs     turn 1  obs   turn 2
    expected = [0, 0, 0, 0.5, 0.5, 0, 0, -0.5, 0, 0, 0.5, 0.5, 0.5]
    assert batch.advantages[0, : len(seg)].tolist() == expected
    assert batch.advantages[1, :4].tolist() == [0, 0, 0, -1.0]
    assert float(batch.advantages[~batch.loss_mask].abs().sum()) == 0  # prompts, tools: none
    # lam = 1: A_t = G - V(s_t) = [1 - 0.5, 1 - 1, 1 - 0.5]
    lam1 = load_config(None, [*OVERRIDES, "algorithm.turn_lam=1.0"])
    assert turn_credit(env, policy, lam1, scored)[0][0] == pytest.approx([0.5, 0.0, 0.5])


def test_summary_actions_take_the_next_turn_and_spans_must_match():
    seg = segment([10], [11])
    seg.provenance["actions"][1]["turn"] = 5  # a summary after the last turn: the last turn's
    assert turn_token_advantages(seg, [1.0, 2.0]) == [0, 0, 0, 1.0, 0, 0, 2.0]
    seg.provenance["actions"].pop()
    with pytest.raises(ValueError, match="action spans"):
        turn_token_advantages(seg, [1.0, 2.0])


def test_config_requires_branching_with_vineppo_and_only_then():
    with pytest.raises(ConfigError, match="rollout.branch"):
        load_config(None, ["algorithm.advantage=vineppo"])
    with pytest.raises(ConfigError, match="rollout.branch"):
        load_config(None, ["rollout.branch.k=2", "rollout.branch.every=1"])
    with pytest.raises(ConfigError, match="rollout.branch"):
        load_config(None, ["reward.shaping=0.5"])
    with pytest.raises(ConfigError, match="turns or every"):
        load_config(None, ["rollout.branch.k=2"])


# --- shaping: the visible failing tests' progress -------------------------------------------

IDS = ["tests/t.py::test_a", "tests/t.py::test_b"]
TASK = SimpleNamespace(id="r", kind="repo", FAIL_TO_PASS=[*IDS, "tests/t.py::test_hidden"], held_out_tests=["tests/t.py::test_hidden"], hidden_tests={})  # fmt: skip


def tc(turn: int, observation: str, name: str = "run", status: str = "ok"):
    return SimpleNamespace(turn=turn, name=name, status=status, observation=observation)


def test_the_harness_reads_only_runs_it_executed_and_only_visible_tests():
    out = "tests/t.py::test_a PASSED [50%]\nFAILED tests/t.py::test_b - AssertionError\n"
    assert visible_outcomes(out, IDS) == {IDS[0]: True, IDS[1]: False}
    assert visible_outcomes("PASSED tests/t.py::test_ab", IDS) == {}  # whole ids only
    calls = [
        tc(1, "PASSED tests/t.py::test_a", name="write_file"),  # not a run
        tc(1, "PASSED tests/t.py::test_a", status="broken"),  # a run the harness did not execute
        tc(2, "PASSED tests/t.py::test_hidden"),  # held out: never part of the potential
        tc(2, out),
        tc(3, "FAILED tests/t.py::test_a"),
    ]
    assert visible_potentials(calls, IDS, 4) == [0.0, 0.0, 0.5, 0.0, 0.0]
    ep = record("good", 4)
    ep.episode = SimpleNamespace(tool_calls=calls)
    cfg = load_config(None, [*OVERRIDES, "reward.shaping=1.0"])
    assert potentials_of(cfg, ep, TASK) == [0.0, 0.0, 0.5, 0.0, 0.0]


def shaped_return(rewards: list[float], gamma: float) -> float:
    return sum(gamma**t * r for t, r in enumerate(rewards))


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_shaping_keeps_the_order_of_complete_episodes_and_fakes_add_nothing(gamma):
    honest = [tc(1, "FAILED tests/t.py::test_a\nFAILED tests/t.py::test_b"), tc(3, "PASSED tests/t.py::test_a\nPASSED tests/t.py::test_b")]  # fmt: skip
    fake = [tc(1, "PASSED tests/t.py::test_a\nPASSED tests/t.py::test_b")]  # echo'd by the policy
    partial = [tc(2, "PASSED tests/t.py::test_a")]
    cases = [(1.0, 3, honest), (0.0, 3, fake), (0.0, 2, partial), (1.0, 1, [])]
    cfg = load_config(None, [*OVERRIDES, "reward.shaping=1.0", f"algorithm.gamma={gamma}"])
    unshaped, shaped = [], []
    for outcome, turns, calls in cases:
        ep = record("good" if outcome else "bad", turns)
        ep.episode = SimpleNamespace(tool_calls=calls)
        phi = potentials_of(cfg, ep, TASK)
        assert phi is not None
        unshaped.append(shaped_return(turn_rewards(outcome, turns, None, gamma, 0.0), gamma))
        shaped.append(shaped_return(turn_rewards(outcome, turns, phi, gamma, 1.0), gamma))
    # Phi(s_0) = 0: the shaped return of every complete episode is its outcome
    assert shaped == pytest.approx(unshaped) and unshaped == [gamma**2, 0.0, 0.0, 1.0]
    # the fake raised Phi(s_1) to 1: F_0 = gamma * 1 - 0, F_1 = gamma - 1, and the pinned
    # terminal potential takes it back on the last turn, F_2 = gamma * 0 - 1
    faked = turn_rewards(0.0, 3, [0.0, 1.0, 1.0, 1.0], gamma, 1.0)
    assert faked == pytest.approx([gamma, gamma - 1.0, -1.0])
    # were the terminal potential Phi(s_3) = 1 kept instead, the fake would gain gamma^3
    unpinned = faked[:2] + [faked[2] + gamma * 1.0]
    assert shaped_return(unpinned, gamma) == pytest.approx(gamma**3) and gamma**3 > 0
