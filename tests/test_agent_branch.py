"""Branched episodes: continuations forked at turn boundaries start from the parent's exact
conversation and workspace, diverge independently, and leave the parent's sandbox untouched.
A ScriptedPolicy drives them; the sandboxes are real (bubblewrap where it runs)."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import pytest
from test_agent_loop import (
    one_torch_thread,  # noqa: F401 - the fixture, used by name
    tiny_model_episodes,
)
from test_agent_tools import PLAIN_CHATML, make_repo, open_sandbox

from coderl.agent import episode as E
from coderl.agent.branch import BranchSpec
from coderl.agent.episode import EpisodeConfig, SimpleTask
from coderl.agent.parsing import CALL_FORMATS
from coderl.agent.runner import run_episodes
from coderl.agent.scripted import ScriptedPolicy
from coderl.policy import load_policy
from coderl.policy.tiny import tiny_tokenizer

call = CALL_FORMATS["hermes"].format_call


@pytest.fixture(scope="module")
def tok():
    t = tiny_tokenizer()
    t.chat_template = PLAIN_CHATML
    return t


def first_turn() -> str:
    return call("write_file", {"path": "notes.txt", "content": "written in turn 1\n"})


def second_turn(tag: str) -> str:
    command = f"cat notes.txt && echo {tag} > out.txt"
    return call("run", {"command": command}) + call("submit", {})


class Script:
    """Turn 1: write notes.txt. At s_1 (the same prompt, asked three times: the parent and its
    two continuations) the n-th asker gets variant n: cat notes.txt, write its tag, submit."""

    def __init__(self) -> None:
        self.seen: Counter[str] = Counter()

    def __call__(self, prompt: str) -> str:
        if "<|im_start|>tool" not in prompt:
            return first_turn()
        self.seen[prompt] += 1
        return second_turn(f"variant{self.seen[prompt]}")


def test_continuations_share_the_prefix_diverge_and_leave_the_parent_untouched(tok, tmp_path: Path):
    base = make_repo(tmp_path)
    script = Script()
    policy = ScriptedPolicy(tok, script)
    cfg = EpisodeConfig(branch=BranchSpec(turns=(1,), k=2))
    with open_sandbox(base) as sandbox:
        (ep,) = run_episodes(policy, [(SimpleTask("calc", "Write notes."), sandbox)], cfg)
        parent_out = sandbox.exec("cat out.txt").stdout
        listing = sandbox.exec("ls").stdout.split()
    assert ep.stats.finish_reason == "submitted" and ep.stats.turns == 2
    assert [(b.turn, b.index) for b in ep.branches] == [(1, 0), (1, 1)]
    assert len(script.seen) == 1 and list(script.seen.values()) == [3]  # one s_1 prompt, 3 askers
    # the three second turns were sampled in one call (the parent's and both continuations')
    assert 3 in policy.batch_sizes

    (pseg,) = ep.trajectory.segments
    starts = [s for kind, s, _ in pseg.provenance["spans"] if kind == "action"]
    tags = set()
    for b in ep.branches:
        child = b.episode
        assert child.episode_id == f"{ep.episode_id}@1.{b.index}"
        assert child.error is None and child.stats.finish_reason == "submitted"
        assert child.stats.turns == 2 and child.branches == []  # a continuation does not branch
        (cseg,) = child.trajectory.segments
        # the exact same conversation up to s_1: token ids, masks, and the transcript
        assert cseg.token_ids[: starts[1]] == pseg.token_ids[: starts[1]]
        assert cseg.loss_mask[: starts[1]] == pseg.loss_mask[: starts[1]]
        assert child.transcripts[0][:4] == ep.transcripts[0][:4]
        assert [c.name for c in child.tool_calls] == ["write_file", "run", "submit"]
        # the same workspace state: the continuation read the parent's turn-1 file
        assert "written in turn 1" in child.tool_calls[1].observation
        tag = next(t for t in ("variant1", "variant2", "variant3") if t in child.diff)
        tags.add(tag)
        assert "+written in turn 1" in child.diff
    parent_tag = parent_out.strip()
    assert parent_tag.startswith("variant") and parent_tag not in tags and len(tags) == 2
    # the parent's sandbox saw none of its continuations' writes, and its diff only its own
    assert f"+{parent_tag}" in ep.diff and all(t not in ep.diff for t in tags)
    assert sorted(listing) == ["notes.txt", "out.txt", "pkg", "test_calc.py"]
    # the actions carry their turn (0-based) for per-turn credit
    assert [a["turn"] for a in pseg.provenance["actions"]] == [0, 1]


def test_every_and_a_boundary_past_the_end(tok, tmp_path: Path):
    """``every=1`` forks at s_1 only when the episode ends at turn 2: no fork at the terminal."""
    base = make_repo(tmp_path)
    policy = ScriptedPolicy(tok, Script())
    cfg = EpisodeConfig(branch=BranchSpec(every=1, k=1))
    with open_sandbox(base) as sandbox:
        (ep,) = run_episodes(policy, [(SimpleTask("calc", "Write notes."), sandbox)], cfg)
    assert [(b.turn, b.index) for b in ep.branches] == [(1, 0)]
    assert BranchSpec(every=2, k=1).at(4) and not BranchSpec(turns=(2,), k=0).at(2)
    with pytest.raises(ValueError, match="turns"):
        BranchSpec(turns=(0,), k=1)


def test_continuations_of_a_function_task_are_graded_by_its_hidden_check(tok, tmp_path: Path):
    """Through the environment: ``rollout_branched`` forks the task's real sandbox, and each
    continuation is graded by the task's own hidden check, like any episode."""
    from coderl.config import load_config
    from coderl.envs.agent import AgentEnvironment
    from coderl.policy.base import SamplingParams
    from coderl.tasks.humaneval import humaneval_tasks
    from coderl.tasks.patches import apply_patch

    task = humaneval_tasks("train")[0]
    for rel, text in task.workspace_files.items():
        (tmp_path / rel).write_text(text)
    apply_patch(tmp_path, task.gold_patch)
    fixed = (tmp_path / "solution.py").read_text()
    seen: Counter[str] = Counter()

    def script(prompt: str) -> str:
        if "<|im_start|>tool" not in prompt:
            return call("run", {"command": "ls"})
        seen[prompt] += 1  # askers 1 and 3 write the gold solution, asker 2 submits as is
        write = call("write_file", {"path": "solution.py", "content": fixed})
        return (write if seen[prompt] != 2 else "") + call("submit", {})

    limits = ["rollout.max_new_tokens=8192", "rollout.max_context_tokens=32768"]  # tiny vocab
    cfg = load_config(None, ["rollout.max_turns=3", "rollout.group_size=2", *limits])
    env = AgentEnvironment(cfg, humaneval_tasks)
    (ep,) = env.rollout_branched(
        ScriptedPolicy(tok, script), [task], SamplingParams(), 1, BranchSpec(turns=(1,), k=2)
    )
    records = [ep] + [r for _, r in ep.branches]
    assert [t for t, _ in ep.branches] == [1, 1] and all(r.failure is None for r in records)
    grades = env.grade([task] * 3, records)
    wrote = ["solution.py" in (r.answer or "") for r in records]
    assert [g.resolved for g in grades] == wrote and sorted(wrote) == [False, True, True]
    assert all(g.grading_error is None for g in grades)


_FORK, _RUN_CALLS = E._fork, E._run_calls  # what delay() wraps, however often it is called


def delay(monkeypatch, *, forks_of: int | None, tools_of: int | None, seconds=0.2) -> None:
    """Make the forks of job ``forks_of``'s episode and the tool calls of job ``tools_of``'s
    episode and its continuations take ``seconds`` longer (None: no job's)."""

    def of(job: int | None, episode_id: str) -> bool:  # ids: "{task}/{job}[@{turn}.{k}]"
        return job is not None and (episode_id.endswith(f"/{job}") or f"/{job}@" in episode_id)

    def slow_fork(st, tools):
        time.sleep(seconds if of(forks_of, st.episode.episode_id) else 0)
        return _FORK(st, tools)

    def slow_calls(st, text, tools):
        time.sleep(seconds if of(tools_of, st.episode.episode_id) else 0)
        return _RUN_CALLS(st, text, tools)

    monkeypatch.setattr(E, "_fork", slow_fork)
    monkeypatch.setattr(E, "_run_calls", slow_calls)


@pytest.mark.usefixtures("one_torch_thread")
def test_how_long_tool_calls_and_forks_take_changes_no_sampled_token(tmp_path: Path, monkeypatch):
    """The tiny random model (real sampling: one RNG stream per generate call, float numerics
    that depend on which rows share it) in real sandboxes, a group of two branched episodes, run
    three times with different delays in forks and tool calls: the tokens and logprobs are the
    same, bit for bit. The runner before rounds sampled the episodes that were ready after a
    20 ms wait, so a fork or tool call that outlasted it split the batch and changed them."""
    policy = load_policy("tiny-random", reference=False)
    base = make_repo(tmp_path)
    task, cfg = tiny_model_episodes(max_turns=3, branch=BranchSpec(turns=(1,), k=1))

    def sampled(forks_of: int | None, tools_of: int | None) -> list[tuple[list[int], list[float]]]:
        delay(monkeypatch, forks_of=forks_of, tools_of=tools_of)
        boxes = [open_sandbox(base) for _ in range(2)]
        try:
            eps = run_episodes(policy, [(task, box) for box in boxes], cfg)
        finally:
            for box in boxes:
                box.close()
        everyone = eps + [b.episode for e in eps for b in e.branches]
        assert len(everyone) == 4 and all(e.error is None for e in everyone)
        return [(s.token_ids, s.behavior_logprobs) for e in everyone for s in e.trajectory.segments]

    first = sampled(forks_of=None, tools_of=None)
    assert first == sampled(forks_of=0, tools_of=None)  # the second turns split on the old runner
    assert first == sampled(forks_of=None, tools_of=1)  # every turn after the first did


def test_a_fork_the_parents_workspace_breaks_is_a_scored_continuation(tok, tmp_path: Path):
    """Turn 1 leaves a tree past PATH_MAX in the workspace: every fork at s_1 fails on the copy,
    and each continuation is the agent's failure (scored on an empty diff), not an infra mask."""
    long = "d" * 200
    deep = f"mkdir junk && cd junk && for i in $(seq 25); do mkdir {long} && cd {long}; done; echo made"

    def script(prompt: str) -> str:
        if "<|im_start|>tool" not in prompt:
            return call("run", {"command": deep})
        return call("submit", {})

    cfg = EpisodeConfig(branch=BranchSpec(turns=(1,), k=3))
    with open_sandbox(make_repo(tmp_path)) as sandbox:
        task = SimpleTask("calc", "Fix it.")
        (ep,) = run_episodes(ScriptedPolicy(tok, script), [(task, sandbox)], cfg)
    assert ep.stats.finish_reason == "submitted" and ep.failure is None
    assert len(ep.branches) == 3
    for b in ep.branches:
        assert b.episode.failure == "agent" and "WorkspaceError" in (b.episode.error or "")
        assert b.episode.diff == ""
