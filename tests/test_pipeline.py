"""The rollout-to-batch pipeline: failure attribution (agent-caused failures are scored, infra
failures masked and counted, with an alarm), group baselines without masked members, and no
import circles among the drivers."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch
from import_graph import cycle_through as _cycle_through
from import_graph import import_graph, modules

from coderl.config import load_config
from coderl.envs import EpisodeRecord, GradeRecord
from coderl.policy.loading import load_policy
from coderl.train import pipeline as P
from coderl.train.sampling import TaskSampler
from coderl.trajectory import Segment, Trajectory

TOY = Path(__file__).parent.parent / "configs" / "toy.yaml"
CFG = load_config(TOY, ["reward.terms={tests: 1.0, broken_calls: 1.0}", "reward.tests=resolved"])


class Task:
    def __init__(self, i: int):
        self.id = f"t{i}"


class FixedGrades:
    """An environment whose grader returns the grades it was given."""

    def __init__(self, grades: list[GradeRecord]):
        self.grades = grades

    def grade(self, tasks, episodes):
        return list(self.grades)

    def token_budget(self) -> int:
        return 16

    def ease(self, task) -> float | None:
        return None


def record(finish: str = "submitted", **kw) -> EpisodeRecord:
    seg = Segment()
    seg.append_context([5, 6, 7], kind="prompt")
    seg.append_sampled([8, 9], [-1.0, -1.0], 0)
    return EpisodeRecord("t0", Trajectory([seg]), finish_reason=finish, **kw)


def scored(pairs: list[tuple[EpisodeRecord, GradeRecord]]) -> P.Scored:
    eps, grades = [e for e, _ in pairs], [g for _, g in pairs]
    tasks = [Task(0)] * len(eps)
    keys = [P.group_key("t0", 0)] * len(eps)
    return P.score(FixedGrades(grades), None, CFG, tasks, keys, eps)


SOLVED = GradeRecord(resolved=True, fraction_passed=1.0)

AGENT_CAUSED = {
    # the policy's calls were broken until the harness gave up
    "broken_calls_ending": (record("broken_calls", broken_tool_calls=3), SOLVED),
    # its self-summary left the next window no room (was: "error", masked)
    "summary_overflow": (record("context"), SOLVED),
    # a workspace it made that the harness cannot walk (a 1,000-deep tree)
    "unwalkable_workspace": (
        record("error", failure="agent", failure_reason="RecursionError"),
        GradeRecord(),
    ),
    # its code broke the grader's test run (the grader says so): a failed grade, not a mask
    "grader_broken_by_agent_code": (
        record(),
        GradeRecord(resolved=True, grading_error="test run killed", failure_kind="agent"),
    ),
}

INFRA = {
    "harness_exception": (record("error"), SOLVED),
    "sandbox_did_not_start": (
        EpisodeRecord("t0", Trajectory(), "error", 0, failure="infra", failure_reason="no env"),
        GradeRecord(grading_error="not graded"),
    ),
    "grader_error_without_a_kind": (record(), GradeRecord(grading_error="docker died")),
    "grader_infra_kind": (
        record(),
        GradeRecord(resolved=True, grading_error="timeout of the grader", failure_kind="infra"),
    ),
}


@pytest.mark.parametrize("name", sorted(AGENT_CAUSED))
def test_agent_caused_failures_are_scored_as_failures(name):
    ep, grade = AGENT_CAUSED[name]
    kind, reason = P.attribute(ep, grade)
    assert kind == "agent" and reason
    s = scored([(ep, grade), (record(), SOLVED)])
    assert s.rewards.valid == [True, True]  # scored, never masked
    resolved_counts = ep.finish_reason in ("broken_calls", "context")  # the grade itself stands
    assert s.rewards.breakdown[0]["tests"] == (1.0 if resolved_counts else 0.0)
    penalty = -CFG.reward.broken_call_penalty * min(ep.broken_tool_calls, 5)
    assert s.rewards.breakdown[0]["broken_calls"] == pytest.approx(penalty)
    m = P.step_metrics(s.infos, CFG)
    assert (m["agent_failed_rate"], m["infra_failed_rate"], m["masked_rate"]) == (0.5, 0.0, 0.0)


def test_a_grade_the_agent_broke_never_counts_as_solved():
    ep, grade = AGENT_CAUSED["grader_broken_by_agent_code"]
    s = scored([(ep, grade)])
    assert s.samples[0].resolved is False and s.rewards.totals == [0.0]


@pytest.mark.parametrize("name", sorted(INFRA))
def test_infra_failures_are_masked_and_counted(name, caplog):
    ep, grade = INFRA[name]
    assert P.attribute(ep, grade)[0] == "infra"
    s = scored([(ep, grade), (record(), SOLVED), (record(), GradeRecord())])
    assert s.rewards.valid == [False, True, True] and math.isnan(s.rewards.totals[0])
    assert s.rewards.counts["grading_errors"] == 1 and s.rewards.counts["masked"] == 1
    with caplog.at_level(logging.WARNING, logger="coderl.train"):
        m = P.step_metrics(s.infos, CFG)
    assert m["infra_failed_rate"] == pytest.approx(1 / 3) and m["agent_failed_rate"] == 0.0
    assert m["masked_rate"] == pytest.approx(1 / 3)
    assert m["alarm/masked"] == 1.0 and "reward.mask_alarm_rate" in caplog.text
    # the masked sample leaves its group's pass rate: 1 of the 2 gradable episodes resolved
    assert s.samples[1].group_pass_rate == 0.5
    assert m["resolved_rate"] == 0.5


def test_infra_wins_over_agent_and_no_failure_is_none():
    assert P.attribute(record("broken_calls"), GradeRecord(grading_error="x"))[0] == "infra"
    assert P.attribute(record(), SOLVED) == (None, "")
    assert P.attribute(record("max_turns", truncated=True), GradeRecord()) == (None, "")


def test_no_alarm_below_the_threshold(caplog):
    cfg = CFG.model_copy(update={"reward": CFG.reward.model_copy(update={"mask_alarm_rate": 0.5})})
    s = scored([(record("error"), SOLVED), (record(), SOLVED), (record(), GradeRecord())])
    with caplog.at_level(logging.WARNING, logger="coderl.train"):
        m = P.step_metrics(s.infos, cfg)
    assert m["alarm/masked"] == 0.0 and caplog.text == ""


def test_masked_members_leave_their_groups_baseline():
    # group A: rewards 1, 0 and a masked member (NaN); group B: 1, 1. Renormalised over the
    # remaining members: A's mean is 0.5 and its std (unbiased, 2 members) 0.7071, so GRPO gives
    # +-0.5 / 0.7071 = +-0.7071; B has no variance and gets 0. The masked row is not in the batch.
    policy = load_policy("tiny-random")
    eps = [record() for _ in range(5)]
    totals = [1.0, 0.0, math.nan, 1.0, 1.0]
    valid = [True, True, False, True, True]
    keys = ["A#0", "A#0", "A#0", "B#1", "B#1"]
    batch = P.make_batch(CFG, policy, None, [e.trajectory for e in eps], totals, valid, keys)
    assert batch is not None and batch.size == 4
    torch.testing.assert_close(
        batch.advantages, torch.tensor([0.7071, -0.7071, 0.0, 0.0]), atol=1e-3, rtol=0
    )
    assert P.make_batch(CFG, policy, None, [eps[0].trajectory], [math.nan], [False], ["A"]) is None


def test_task_sampler_stream_is_the_cursor_order():
    tasks = [Task(i) for i in range(5)]
    s = TaskSampler(tasks, seed=3)
    streamed = [s.at(i)[0] for i in range(12)]
    assert [t.id for t in s.next(12)] == streamed and s.position == 12
    assert sorted(streamed[:5]) == sorted(t.id for t in tasks)  # each epoch a permutation
    resumed = TaskSampler(tasks, seed=3, position=7)
    assert [p for p, _ in resumed.take(2)] == [7, 8]
    assert [t.id for _, t in TaskSampler(tasks, 3, 7).take(5)] == streamed[7:12]


# ---------------------------------------------------------------- import circles
DRIVERS = ("coderl.train", "coderl.envs", "coderl.asyncrl", "coderl.eval", "coderl.online.update")


def test_no_import_circles_through_the_drivers_and_no_module_over_600_lines():
    mods = modules()
    graph = import_graph(mods)
    # only the commands that run it (coderl.cli: train, demo) import the recipe
    users = {m for m in mods if "coderl.train.loop" in graph[m] and m != "coderl.train"}
    assert users and all(m.startswith("coderl.cli.") for m in users), (
        f"the coderl train recipe is imported as a library: {sorted(users)}"
    )
    cycles = [c for m in sorted(mods) if m.startswith(DRIVERS) if (c := _cycle_through(m, graph))]
    assert not cycles, cycles
    for m in mods:
        if m.startswith(DRIVERS):
            assert len(mods[m].read_text().splitlines()) <= 600, m


def test_a_sandbox_that_cannot_start_masks_its_episodes_and_the_rest_run(monkeypatch):
    from coderl.agent.parsing import CALL_FORMATS
    from coderl.agent.scripted import ScriptedPolicy
    from coderl.envs import agent as agent_env
    from coderl.policy.base import SamplingParams
    from coderl.policy.tiny import tiny_tokenizer
    from coderl.sandbox.base import SandboxError

    cfg = load_config(
        Path(__file__).parent.parent / "configs" / "default.yaml", ["model.name=tiny-random"]
    )
    env = agent_env.humaneval_environment(cfg)
    tasks = env.tasks("train")[:2]
    real = agent_env.sandbox_for

    def flaky(task):
        if task.id == tasks[1].id:
            raise SandboxError("bubblewrap is missing")
        return real(task)

    monkeypatch.setattr(agent_env, "sandbox_for", flaky)
    submit = CALL_FORMATS[env.episode_config(SamplingParams()).call_format].format_call
    policy = ScriptedPolicy(tiny_tokenizer(), lambda prompt: submit("submit", {}))
    records = env.rollout(policy, tasks, SamplingParams(seed=0), 2)
    assert [r.task_id for r in records] == [tasks[0].id] * 2 + [tasks[1].id] * 2
    assert [r.failure for r in records] == [None, None, "infra", "infra"]
    assert "bubblewrap is missing" in records[2].failure_reason
    owners = [t for t in tasks for _ in range(2)]
    s = P.score(env, policy, cfg, owners, [P.group_key(t.id, 0) for t in owners], records)
    assert s.rewards.valid == [True, True, False, False]
    assert P.step_metrics(s.infos, cfg)["infra_failed_rate"] == 0.5


def test_a_bug_in_the_sandbox_factory_is_raised_not_masked():
    """Only a sandbox that cannot start (``SETUP_FAULTS``) becomes an ``infra`` record; a bug in
    the factory is raised to the caller with its message, not masked on every episode."""
    from types import SimpleNamespace

    from coderl.envs.agent import AgentEnvironment
    from coderl.policy.base import SamplingParams

    def buggy(task):
        raise TypeError("instance_sandbox() got an unexpected keyword argument")

    env = AgentEnvironment(None, lambda split: [], sandbox=buggy)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="unexpected keyword"):
        env.rollout(None, [SimpleNamespace(id="t/1")], SamplingParams(), 1)  # type: ignore[arg-type]
