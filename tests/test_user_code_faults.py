"""User code that raises inside a rollout or a grading batch (a plugin tool, a shaping
potential, a plugin grader) ends its own episode or sample, never the batch, whatever it raises:
``SystemExit`` and other ``BaseException`` subclasses included, ``KeyboardInterrupt`` excepted.

A tool's raise is the agent's outcome (an observation in a scored episode: the policy chose the
arguments); a potential's or a grader's is a host fault (masked, ``failure="infra"``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_agent_tools import PLAIN_CHATML, make_repo, open_sandbox

from coderl.agent.episode import EpisodeConfig, SimpleTask
from coderl.agent.parsing import CALL_FORMATS
from coderl.agent.runner import run_episodes
from coderl.agent.scripted import ScriptedPolicy
from coderl.agent.tools import TOOLS, TOOLSETS, ToolContext, make_tool
from coderl.policy.tiny import tiny_tokenizer

call = CALL_FORMATS["hermes"].format_call


class LibraryStop(BaseException):
    """What a library may raise that is not an ``Exception`` (pytest's ``skip``/``fail``, a
    framework's cancellation)."""


RAISES = {
    "exit": lambda: SystemExit(3),
    "generator_exit": lambda: GeneratorExit("closed"),
    "library": lambda: LibraryStop("stopped"),
}


def probe(ctx: ToolContext, what: str) -> str:
    """A plugin tool that raises what it is asked to.

    Args:
        what: which exception to raise, or anything else to answer "fine".
    """
    if what in RAISES:
        raise RAISES[what]()
    return "fine"


@pytest.fixture(scope="module")
def tok():
    t = tiny_tokenizer()
    t.chat_template = PLAIN_CHATML
    return t


def _script(prompt: str) -> str:
    """Each episode calls ``probe`` with the word its statement names, then submits."""
    if "<|im_start|>tool" in prompt:
        return call("submit", {})
    word = next(w for w in (*RAISES, "nothing") if f"probe:{w}." in prompt)
    return call("probe", {"what": word})


def _run(tok, tmp_path: Path, words: list[str], **cfg_kw) -> list:
    registry = {**TOOLS, "probe": make_tool(probe)}
    cfg = EpisodeConfig(toolsets={"repo": (*TOOLSETS["repo"], "probe")}, **cfg_kw)
    boxes = [open_sandbox(make_repo(tmp_path / str(i))) for i in range(len(words))]
    try:
        jobs = [
            (SimpleTask(f"t{i}", f"probe:{w}."), b)
            for i, (w, b) in enumerate(zip(words, boxes, strict=True))
        ]
        return run_episodes(ScriptedPolicy(tok, _script), jobs, cfg, registry=registry)
    finally:
        for b in boxes:
            b.close()


def test_a_plugin_tool_that_exits_is_an_observation_of_its_episode_only(tok, tmp_path: Path):
    words = [*RAISES, "nothing"]
    episodes = _run(tok, tmp_path, words)
    assert [e.stats.finish_reason for e in episodes] == ["submitted"] * len(words)
    assert all(e.failure is None for e in episodes)
    first = {e.task_id: e.tool_calls[0] for e in episodes}
    for i, w in enumerate(words):
        rec = first[f"t{i}"]
        if w == "nothing":
            assert (rec.status, rec.observation) == ("ok", "fine")
        else:
            name = type(RAISES[w]()).__name__
            assert rec.status == "tool_error" and rec.observation.startswith(f"Error: {name}")


def test_a_plugin_tool_cannot_swallow_ctrl_c(tok, tmp_path: Path):
    RAISES["interrupt"] = KeyboardInterrupt
    try:
        with pytest.raises(KeyboardInterrupt):
            _run(tok, tmp_path, ["interrupt"])
    finally:
        del RAISES["interrupt"]


@pytest.mark.parametrize("raised", [SystemExit(2), GeneratorExit("not a close")])
def test_a_potential_that_exits_masks_its_episode_only(tok, tmp_path: Path, raised):
    """The shaping potential (run after each ``run`` call) raises on the episode whose
    statement says so; the other episode of the batch ends normally. A ``GeneratorExit`` from a
    tool request must not read as the episode generator being closed."""

    def potential(task, sandbox) -> float:
        if "exit" in task.problem_statement:
            raise raised
        return 0.5

    def script(prompt: str) -> str:
        if "<|im_start|>tool" in prompt:
            return call("submit", {})
        return call("run", {"command": "true"})

    cfg = EpisodeConfig(potential=potential)
    boxes = [open_sandbox(make_repo(tmp_path / str(i))) for i in range(2)]
    try:
        jobs = [(SimpleTask("a", "probe:exit."), boxes[0]), (SimpleTask("b", "fine."), boxes[1])]
        exited, fine = run_episodes(ScriptedPolicy(tok, script), jobs, cfg)
    finally:
        for b in boxes:
            b.close()
    assert exited.stats.finish_reason == "error" and exited.failure == "infra"
    assert type(raised).__name__ in exited.error
    assert fine.stats.finish_reason == "submitted" and fine.failure is None
    assert fine.tool_calls[0].potential == 0.5


@pytest.mark.parametrize("raised", [SystemExit(1), LibraryStop("x"), RuntimeError("bug")])
def test_a_plugin_grader_that_exits_masks_its_sample_only(raised):
    from coderl.config import load_config
    from coderl.envs.agent import AgentEnvironment
    from coderl.envs.base import EpisodeRecord
    from coderl.grading.verdict import GradeResult
    from coderl.trajectory import Trajectory

    def grader(task, diff, timeout):
        if diff == "bad":
            raise raised
        return GradeResult(task.id, resolved=True)

    tasks = [SimpleTask("a", ""), SimpleTask("b", "")]
    env = AgentEnvironment(load_config(None, []), lambda split: tasks, grader=grader)
    eps = [
        EpisodeRecord(t.id, Trajectory(), answer=a)
        for t, a in zip(tasks, ["bad", "good"], strict=True)
    ]
    bad, good = env.grade(tasks, eps)
    assert bad.failure_kind == "infra" and type(raised).__name__ in bad.grading_error
    assert good.resolved and good.grading_error is None
