"""The episode loop driven by a ScriptedPolicy: tool use, broken calls, limits, summarisation,
concurrency; token-exactness of every segment."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_agent_tools import PLAIN_CHATML, make_repo, open_sandbox

from coderl.agent.episode import EpisodeConfig, SampleRequest, SimpleTask
from coderl.agent.parsing import CALL_FORMATS
from coderl.agent.runner import run_episode, run_episodes, sample_batch
from coderl.agent.scripted import ScriptedPolicy
from coderl.cli import agent as agent_cli
from coderl.policy import load_policy
from coderl.policy.tiny import tiny_tokenizer
from coderl.policy.vllm_engine import VLLMEngine
from coderl.sandbox import Sandbox

call = CALL_FORMATS["hermes"].format_call
TASK = "Fix add() in pkg/calc.py so that test_calc.py passes."
RUN_TESTS = "python3 -c 'from pkg.calc import add; assert add(2, 3) == 5; print(\"tests pass\")'"


@pytest.fixture(scope="module")
def tok():
    t = tiny_tokenizer()
    t.chat_template = PLAIN_CHATML  # the default model's template: no tool support
    return t


@pytest.fixture
def setup(tmp_path: Path):
    base = make_repo(tmp_path)
    task = SimpleTask("calc", TASK)
    made = []

    def sandbox(name: str = "work") -> Sandbox:
        made.append(open_sandbox(base))
        return made[-1]

    yield task, sandbox
    for s in made:
        s.close()


def reply_ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]  # + <|im_end|>


def trainable(seg) -> list[int]:
    return [t for t, m in zip(seg.token_ids, seg.loss_mask, strict=True) if m]


def action_starts(seg) -> list[int]:
    return [start for kind, start, _ in seg.provenance["spans"] if kind == "action"]


def assert_token_exact(episode, policy):
    """Every sampled span sits right after exactly the prompt it was sampled from."""
    prompts = iter(policy.prompts)
    for seg in episode.trajectory.segments:
        assert len(seg.token_ids) == len(seg.loss_mask) == len(seg.behavior_logprobs)
        seg.validate()
        for start in action_starts(seg):
            assert seg.token_ids[:start] == next(prompts)
    assert next(prompts, None) is None


def test_scripted_episode_reads_edits_runs_tests_and_submits(tok, setup):
    task, sandbox = setup
    script = [
        "Let me read the code.\n" + call("read_file", {"path": "pkg/calc.py"}),
        call("edit", {"path": "pkg/calc.py", "old": "return a - b", "new": "return a + b"}),
        call(
            "edit",
            {
                "path": "pkg/calc.py",
                "old": "add(a, b):\n    return a - b",
                "new": "add(a, b):\n    return a + b",
            },
        ),
        call("run", {"command": RUN_TESTS}),
        "Tests pass.\n" + call("submit", {}),
    ]
    policy = ScriptedPolicy(tok, script)
    ep = run_episode(policy, task, sandbox(), EpisodeConfig())

    s = ep.stats
    assert (s.finish_reason, s.turns, s.broken_tool_calls, s.no_action_turns) == (
        "submitted",
        5,
        0,
        0,
    )
    assert s.tool_errors == 1 and s.summaries == 0 and ep.error is None
    log = [(c.name, c.status) for c in ep.tool_calls]
    assert log == [
        ("read_file", "ok"),
        ("edit", "tool_error"),
        ("edit", "ok"),
        ("run", "ok"),
        ("submit", "ok"),
    ]
    assert "occurs 2 times" in ep.tool_calls[1].observation  # the ambiguous edit changed nothing:
    assert ep.diff.count("\n+    return a + b") == 1 and ep.diff.count("\n-    return a - b") == 1
    assert ep.tool_calls[3].observation == "exit code 0\nstdout:\ntests pass"
    assert all(c.duration_s >= 0 and c.started_s >= 0 for c in ep.tool_calls)

    (seg,) = ep.trajectory.segments
    expected = [t for text in script for t in reply_ids(tok, text)]
    assert trainable(seg) == expected and s.generated_tokens == len(expected)
    assert all(lp == 0.0 for lp in seg.behavior_logprobs)  # scripted: probability 1 per token
    assert_token_exact(ep, policy)
    # the model saw the numbered file and the edit error in its later prompts
    second_prompt = tok.decode(policy.prompts[1])
    assert "     2\t    return a - b" in second_prompt
    assert "<|im_start|>tool\n" in second_prompt and second_prompt.endswith(
        "<|im_start|>assistant\n"
    )
    assert "occurs 2 times" in tok.decode(policy.prompts[2])
    roles = [m["role"] for m in ep.transcripts[0]]
    assert roles == ["system", "user"] + ["assistant", "tool"] * 5


def test_malformed_and_unknown_calls_are_reported_and_counted(tok, setup):
    task, sandbox = setup
    script = [
        '<tool_call>{"name": "read_file", "arguments": {"path": }}</tool_call>',
        call("teleport", {"to": "mars"}),
        call("read_file", {"path": "pkg/calc.py"}),  # a good call resets the streak
        call("read_file", {"path": 7}),
        call("read_file", {"file": "pkg/calc.py"}),
        "<tool_call>",  # unterminated: third broken call in a row
    ]
    policy = ScriptedPolicy(tok, script)
    ep = run_episode(policy, task, sandbox(), EpisodeConfig(max_consecutive_broken_calls=3))
    assert ep.stats.finish_reason == "broken_calls"
    assert ep.stats.broken_tool_calls == 5 and ep.stats.turns == 6
    assert [c.status for c in ep.tool_calls] == [
        "broken",
        "broken",
        "ok",
        "broken",
        "broken",
        "broken",
    ]
    assert "not valid JSON" in tok.decode(policy.prompts[1])
    assert "unknown tool 'teleport'" in tok.decode(policy.prompts[2])
    assert "argument 'path': Input should be a valid string" in tok.decode(policy.prompts[4])
    assert "missing required argument 'path'" in tok.decode(policy.prompts[5])
    assert "unexpected argument 'file'" in tok.decode(policy.prompts[5])
    assert ep.transcripts[0][-1]["content"].startswith("Error: <tool_call> block not closed")
    assert_token_exact(ep, policy)


def test_broken_call_after_submit_still_counts_and_later_calls_do_not_run(tok, setup):
    task, sandbox = setup
    turn = call("submit", {}) + call("read_file", {"path": "pkg/calc.py"}) + "<tool_call>{}"
    ep = run_episode(ScriptedPolicy(tok, [turn]), task, sandbox(), EpisodeConfig())
    assert [c.status for c in ep.tool_calls] == ["ok", "not_run", "broken"]
    assert (ep.stats.finish_reason, ep.stats.broken_tool_calls) == ("submitted", 1)


def test_a_failing_sandbox_ends_the_episode_with_error(tok, setup):
    task, sandbox = setup
    box = sandbox()
    box.close()  # the sandbox is gone: infrastructure failure, not a tool error for the model
    policy = ScriptedPolicy(tok, [call("run", {"command": "echo hi"})])
    ep = run_episode(policy, task, box, EpisodeConfig())
    assert ep.stats.finish_reason == "error" and "SandboxError" in ep.error
    assert ep.tool_calls == [] and ep.stats.turns == 1
    assert ep.failure == "infra"  # masked by the trainer


def test_a_deep_workspace_is_graded_not_masked(tok, setup):
    # 1,100 nested directories: the diff walk is iterative and depth-capped, so the episode ends
    # normally (the deep files are left out of the diff) instead of as a masked error
    task, sandbox = setup
    deep = "python3 -c \"import os; [(os.mkdir('x'), os.chdir('x')) for _ in range(1100)]\""
    policy = ScriptedPolicy(tok, [call("run", {"command": deep}) + call("submit", {})])
    ep = run_episode(policy, task, sandbox(), EpisodeConfig())
    assert ep.stats.finish_reason == "submitted" and ep.failure is None


def test_a_workspace_the_diff_cannot_walk_is_the_agents_failure(tok, setup, monkeypatch):
    # should a workspace the policy made still defeat the diff (RecursionError, UnicodeError),
    # the episode is an agent failure (scored on an empty diff), never an infra mask
    task, sandbox = setup
    box = sandbox()

    def unwalkable():
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(box, "diff", unwalkable)
    policy = ScriptedPolicy(tok, [call("submit", {})])
    ep = run_episode(policy, task, box, EpisodeConfig())
    assert ep.stats.finish_reason == "error" and "RecursionError" in ep.error
    assert ep.failure == "agent" and ep.diff == ""


def test_xml_calls_on_a_template_with_its_own_tool_format(setup):
    task, sandbox = setup
    native = tiny_tokenizer()  # Qwen2.5-style: renders tools= and describes Hermes JSON calls
    xml = CALL_FORMATS["xml"].format_call
    script = [xml("read_file", {"path": "pkg/calc.py", "end_line": 2}), xml("submit", {})]
    policy = ScriptedPolicy(native, script)
    cfg = EpisodeConfig(call_format="xml", template_tools=False)
    ep = run_episode(policy, task, sandbox(), cfg)
    assert ep.stats.finish_reason == "submitted" and ep.stats.broken_tool_calls == 0
    assert ep.tool_calls[0].arguments == {"path": "pkg/calc.py", "end_line": 2}
    first = native.decode(policy.prompts[0])
    assert "<function=<tool name>>" in first and "return a json object" not in first
    # the template wraps tool results in its own <tool_response> user turn
    assert "<tool_response>\n     1\tdef add(a, b):" in native.decode(policy.prompts[1])
    assert_token_exact(ep, policy)


def test_bad_episode_config_is_refused():
    with pytest.raises(ValueError, match="max_turns"):
        EpisodeConfig(max_turns=0)
    with pytest.raises(ValueError, match="top_p"):
        EpisodeConfig(top_p=1.5)
    with pytest.raises(ValueError, match="problem_statement"):
        EpisodeConfig(task_template="Do it.")


def test_turn_without_a_call_is_a_no_action_turn(tok, setup):
    task, sandbox = setup
    policy = ScriptedPolicy(tok, ["Should I fix add or sub?", call("submit", {})])
    cfg = EpisodeConfig()
    ep = run_episode(policy, task, sandbox(), cfg)
    assert (ep.stats.no_action_turns, ep.stats.turns, ep.stats.finish_reason) == (1, 2, "submitted")
    assert cfg.no_action_message in tok.decode(policy.prompts[1])
    assert ep.diff == ""


def test_turn_and_token_limits(tok, setup):
    task, sandbox = setup
    read = call("read_file", {"path": "pkg/calc.py"})
    ep = run_episode(
        ScriptedPolicy(tok, [read] * 3), task, sandbox("a"), EpisodeConfig(max_turns=2)
    )
    assert (ep.stats.finish_reason, ep.stats.turns) == ("max_turns", 2)

    n = len(reply_ids(tok, read))
    # 1.5 turns of budget: the second turn is cut to n // 2 tokens, then nothing is left.
    cfg = EpisodeConfig(max_tokens=n + n // 2)
    policy = ScriptedPolicy(tok, [read] * 3)
    ep = run_episode(policy, task, sandbox("b"), cfg)
    assert (ep.stats.finish_reason, ep.stats.generated_tokens) == ("max_tokens", n + n // 2)
    assert ep.tool_calls[-1].status == "broken"  # the cut call is unterminated, and counted
    assert_token_exact(ep, policy)


def test_context_budget_too_small_for_the_prompt_is_an_error(tok, setup):
    task, sandbox = setup
    ep = run_episode(ScriptedPolicy(tok, []), task, sandbox(), EpisodeConfig(context_budget=100))
    assert ep.stats.finish_reason == "error" and "context_budget=100" in ep.error
    assert len(ep.trajectory.segments) == 1 and ep.diff == ""


def test_a_self_summary_too_long_for_the_next_window_is_a_context_ending(tok, setup):
    # the policy's summary fills the window it opens: an agent-caused ending ("context"),
    # graded and scored like any other; before, it raised and the episode was masked as "error"
    task, sandbox = setup
    big = "python3 -c \"print('ab ' * 600)\""
    cfg = EpisodeConfig(max_tokens_per_turn=100, summary_max_tokens=400)
    probe = run_episode(ScriptedPolicy(tok, [call("submit", {})]), task, sandbox("p"), cfg)
    prompt_len = len(probe.trajectory.segments[0].token_ids) - len(
        reply_ids(tok, call("submit", {}))
    )
    cfg.context_budget = prompt_len + 450
    replies = iter([call("run", {"command": big}), "lots of words " * 400])
    ep = run_episode(ScriptedPolicy(tok, lambda prompt: next(replies)), task, sandbox(), cfg)
    assert ep.stats.finish_reason == "context" and ep.error is None and ep.failure is None
    assert ep.stats.summaries == 1 and len(ep.trajectory.segments) == 2


def test_self_summarization_crossing_the_budget_twice_gives_three_segments(tok, setup):
    task, sandbox = setup
    big = "python3 -c \"print('ab ' * 600)\""  # ~1800 characters of output
    actions = iter(
        [
            call("run", {"command": "echo small"}),
            call("run", {"command": big}),
            call("run", {"command": big}),
            call("submit", {}),
        ]
    )
    cfg = EpisodeConfig(max_tokens_per_turn=100, summary_max_tokens=60)
    replies: list[str] = []

    def script(prompt: str) -> str:
        asked = prompt.rstrip().endswith("<|im_start|>assistant") and (
            cfg.summary_instruction + "<|im_end|>" in prompt[-len(cfg.summary_instruction) - 50 :]
        )
        replies.append(f"Summary {len(replies)}: ran commands." if asked else next(actions))
        return replies[-1]

    policy = ScriptedPolicy(tok, script)
    probe = run_episode(ScriptedPolicy(tok, [call("submit", {})]), task, sandbox("p"), cfg)
    prompt_len = len(probe.trajectory.segments[0].token_ids) - len(
        reply_ids(tok, call("submit", {}))
    )
    # Room for the prompt, a short summary note, and a few small turns, but not for a big output
    # (~1800 characters, far more than 300 tokens): each big observation forces a summary.
    cfg.context_budget = prompt_len + 450
    ep = run_episode(policy, task, sandbox(), cfg)

    assert ep.stats.finish_reason == "submitted" and ep.error is None
    assert ep.stats.summaries == 2 and len(ep.trajectory.segments) == 3
    summaries = [r for r in replies if r.startswith("Summary")]
    assert len(summaries) == 2
    # segment k holds exactly the replies sampled in it; a summary is the last one of its window
    per_segment: list[list[int]] = [[]]
    for r in replies:
        per_segment[-1] += reply_ids(tok, r)
        if r.startswith("Summary"):
            per_segment.append([])
    for seg, expected in zip(ep.trajectory.segments, per_segment, strict=True):
        assert trainable(seg) == expected
        text = tok.decode(seg.token_ids)
        assert TASK in text  # the task statement is in every window
    assert sum(len(e) for e in per_segment) == ep.stats.generated_tokens
    # the summary opens the next window, as context (not trainable there)
    for k, summary in enumerate(summaries, start=1):
        prompt_end = action_starts(ep.trajectory.segments[k])[0]
        assert summary in tok.decode(ep.trajectory.segments[k].token_ids[:prompt_end])
    assert [seg.provenance["segment"] for seg in ep.trajectory.segments] == [0, 1, 2]
    assert len(ep.transcripts) == 3
    assert_token_exact(ep, policy)


def test_episodes_run_concurrently_with_batched_sampling_in_rounds(tok, tmp_path):
    base = make_repo(tmp_path)
    scripts = {
        "slow": [call("run", {"command": "sleep 2"}), call("submit", {})],
        "fast": [call("read_file", {"path": "pkg/calc.py"})] * 3 + [call("submit", {})],
    }

    def script(prompt: str) -> str:
        name = "slow" if "TASK slow" in prompt else "fast"
        turn = prompt.count("<|im_start|>assistant") - 1
        return scripts[name][turn]

    tasks = [SimpleTask(n, f"TASK {n}") for n in ("slow", "fast", "fast")]
    boxes = [open_sandbox(base) for _ in range(3)]
    policy = ScriptedPolicy(tok, script)
    jobs = list(zip(tasks, boxes, strict=True))
    eps = run_episodes(policy, jobs, EpisodeConfig())
    for box in boxes:
        box.close()
    assert [e.episode_id for e in eps] == ["slow/0", "fast/1", "fast/2"]
    assert all(e.stats.finish_reason == "submitted" for e in eps)
    # rounds: every episode's turn n is in the n-th generate call, so all second turns wait
    # for the slow tool call (2 s, run beside the fast reads) and then share one call; batches
    # never depend on how long a tool call took
    assert policy.batch_sizes == [3, 3, 2, 2]
    assert all(e.stats.wall_time_s >= 2.0 for e in eps)
    assert sum(policy.batch_sizes) == sum(e.stats.turns for e in eps) == 2 + 4 + 4


def test_one_generate_call_serves_different_budgets(tok):
    policy = ScriptedPolicy(tok, ["hello world", "hello world"])
    reqs = [SampleRequest([1, 2], 3, (2,)), SampleRequest([1], 100, (2,))]
    short, full = sample_batch(policy, reqs, EpisodeConfig(), 0)
    assert policy.batch_sizes == [2]
    assert full.token_ids == reply_ids(tok, "hello world") and full.finish_reason == "stop"
    assert short.token_ids == full.token_ids[:3] and short.finish_reason == "length"
    assert len(short.logprobs) == 3


class AbortingPolicy(ScriptedPolicy):
    """An engine that hands on completions with a finish reason coderl does not know."""

    reason: str | None = "abort"

    def generate(self, prompts, params):
        out = super().generate(prompts, params)
        for c in out:
            c.finish_reason = self.reason
        return out


@pytest.mark.parametrize("reason", ["abort", "tool_calls", "", None])
def test_unknown_finish_reason_from_the_engine_raises(tok, reason):
    policy = AbortingPolicy(tok, ["hello world"])
    policy.reason = reason
    with pytest.raises(ValueError, match="unknown finish_reason"):
        sample_batch(policy, [SampleRequest([1, 2], 100, (2,))], EpisodeConfig(), 0)


def test_unknown_finish_reason_stops_the_episodes_instead_of_training_on_them(tok, setup):
    task, sandbox = setup
    policy = AbortingPolicy(tok, [call("submit", {})])
    with pytest.raises(ValueError, match="unknown finish_reason 'abort'"):
        run_episode(policy, task, sandbox(), EpisodeConfig())


@pytest.fixture
def one_torch_thread():
    # On a loaded 2-core box, torch's 2 intra-op threads spin against other processes: a batch
    # of 12 tokens took 17 s with 2 threads and 0.5 s with 1 (measured here).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_model_episodes(**overrides) -> tuple[SimpleTask, EpisodeConfig]:
    """A task and episode settings the tiny random model runs cheaply: two tools and short
    instructions keep the prompt (~500 tokens of its BPE) small; 2 turns of 12 tokens, seed 0."""
    task = SimpleTask("calc", TASK, kind="tiny")
    settings = dict(max_turns=2, max_tokens_per_turn=12, temperature=1.0, seed=0)
    tools = {"tiny": ("read_file", "submit")}
    cfg = EpisodeConfig(instructions="Fix the bug.", toolsets=tools, **{**settings, **overrides})
    return task, cfg


def test_real_tiny_model_episodes_end_to_end_in_sandboxes(tmp_path, one_torch_thread):
    policy = load_policy("tiny-random", reference=False)
    base = make_repo(tmp_path)
    task, cfg = tiny_model_episodes()
    boxes = [open_sandbox(base) for _ in range(2)]  # a group of two episodes on one task
    try:
        eps = run_episodes(policy, [(task, box) for box in boxes], cfg)
    finally:
        for box in boxes:
            box.close()
    for ep in eps:
        assert ep.error is None, ep.error
        s = ep.stats
        assert s.finish_reason in ("max_turns", "broken_calls") and 1 <= s.turns <= 2
        (seg,) = ep.trajectory.segments
        seg.validate()
        assert seg.num_trainable == s.generated_tokens <= 2 * 12
        # random weights emit token soup: every turn is a no-action turn or has broken calls
        broken_turns = {c.turn for c in ep.tool_calls if c.status == "broken"}
        assert s.no_action_turns + len(broken_turns) == s.turns
        assert isinstance(ep.diff, str)
        # token-exact: the trainer's logprobs of the segment match the sampler's on every
        # sampled token, which holds only if each turn's prefix is exactly what was sampled from
        trainer = policy.logprobs([seg.token_ids], cfg.temperature)[0]
        for t, m in enumerate(seg.loss_mask):
            if m:
                assert abs(trainer[t] - seg.behavior_logprobs[t]) < 1e-3


def test_cli_runs_episodes_and_writes_them(tmp_path, one_torch_thread, capsys):
    out = tmp_path / "episodes.json"
    args = ["agent", "--workspace", str(make_repo(tmp_path)), "--task", TASK]
    args += ["--model", "tiny-random", "--episodes", "2", "--max-turns", "1"]
    args += ["--max-tokens-per-turn", "8", "--out", str(out)]
    parser = argparse.ArgumentParser()
    agent_cli.register(parser.add_subparsers())  # only this sub-command: no other imports
    parsed = parser.parse_args(args)
    assert parsed.func(parsed) == 0
    assert "cli/1" in capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert [e["episode_id"] for e in saved] == ["cli/0", "cli/1"]
    seg = saved[0]["trajectory"]["segments"][0]
    assert sum(seg["loss_mask"]) == saved[0]["stats"]["generated_tokens"] <= 8


# --- a prompt past the engine's context ends its episode ("context", scored), not the batch ---


class EngineBacked(ScriptedPolicy):
    """A scripted policy behind a real :class:`VLLMEngine`'s length check (no server: the check
    runs before any request); ``context_limit`` reads its ``max_model_len`` as a served one's."""

    def __init__(self, tok, script, max_model_len: int) -> None:
        super().__init__(tok, script)
        self.engine = VLLMEngine.__new__(VLLMEngine)
        self.engine.max_model_len = max_model_len

    def generate(self, prompts, params):
        if any(len(p) >= self.engine.max_model_len for p in prompts):
            self.engine.generate(prompts, params)  # raises the engine's own ValueError
        return super().generate(prompts, params)


EMOJI = 'python3 -c "print(chr(0x1F600) * 8000)"'  # 8,000 characters, 32,000 tiny tokens


@pytest.mark.parametrize("calls", [1, 3, 16])
def test_a_flood_past_the_engines_context_ends_that_episode_not_the_batch(tok, tmp_path, calls):
    base = make_repo(tmp_path)

    def script(prompt: str) -> str:
        if "TASK flood" in prompt and "<|im_start|>tool" not in prompt:
            return call("run", {"command": EMOJI}) * calls
        if "<|im_start|>tool" not in prompt:
            return call("read_file", {"path": "pkg/calc.py"})
        return call("submit", {})

    policy = EngineBacked(tok, script, max_model_len=2048)
    tasks = [SimpleTask(n, f"TASK {n}") for n in ("flood", "calm")]
    boxes = [open_sandbox(base) for _ in tasks]
    try:
        eps = run_episodes(policy, list(zip(tasks, boxes, strict=True)), EpisodeConfig())
    finally:
        for box in boxes:
            box.close()
    flood, calm = eps
    assert flood.stats.finish_reason == "context" and flood.failure is None and flood.error is None
    assert calm.stats.finish_reason == "submitted"
    assert max(len(p) for p in policy.prompts) < 2048  # no prompt past the context was sent
    from coderl.envs.base import GradeRecord
    from coderl.train.pipeline import attribute

    rec = SimpleNamespace(failure=None, failure_reason="", finish_reason="context")
    assert attribute(rec, GradeRecord())[0] == "agent"  # scored, never a mask


@pytest.mark.parametrize("command", [EMOJI, 'python3 -c "print(chr(0x4E00) * 8000)"'])
def test_an_observation_is_capped_in_tokens_not_only_characters(tok, setup, command):
    task, sandbox = setup
    cfg = EpisodeConfig()
    cfg.tools.max_observation_tokens = 300
    script = [call("run", {"command": command}), call("submit", {})]
    ep = run_episode(ScriptedPolicy(tok, script), task, sandbox(), cfg)
    obs = ep.tool_calls[0].observation
    assert 200 <= len(tok.encode(obs, add_special_tokens=False)) <= 300 and "omitted" in obs


def test_context_limit_reads_every_engine():
    from coderl.policy.base import context_limit
    from coderl.policy.rollout import TorchRollout

    policy = load_policy("tiny-random", reference=False)
    assert context_limit(policy) == context_limit(TorchRollout(policy)) == 4096
    assert context_limit(EngineBacked(tiny_tokenizer(), [], 1234)) == 1234
    assert context_limit(ScriptedPolicy(tiny_tokenizer(), [])) is None
