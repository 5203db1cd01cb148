"""More attacks on the harness, the function checker's wire format and the online path (issue 19).

Each test is an attack a policy can make, asserting the defended outcome: the sample is scored
(a broken call, a tool error, a failed grade), never masked (an episode ``error``, a server 500,
an exception out of a decoder that promises one error type). Kinds tried here and how they fared
before the fixes that came with this file:

- a tool call whose JSON nests past the parser's recursion limit (hermes, xml parameter): the
  parser raised RecursionError, the episode ended ``error`` (masked); now a broken call;
- a tool call holding an integer of more than 4,300 digits (hermes, xml parameter): ValueError
  out of ``json.loads`` (not a JSONDecodeError), masked; on the online server a 500 with no
  interaction stored, so the broken call was never scored; now a broken call / ``invalid``;
- arguments nested ~985 levels (parse at a shallow stack): a broken call, but its arguments were
  kept in the tool log, and the hack detectors (run unguarded in the training pipeline, a few
  frames deeper) raised RecursionError: the whole step crashed; now arguments nested past
  ``MAX_ARGUMENT_DEPTH`` are a broken call and never reach the log;
- one message of 40 cheap ``read_file`` calls of a big file: each returns up to 8,000
  characters, so one turn could add ~320,000 characters to the summary prompt, past a real
  engine's context length (``policy.generate`` raising fails the whole rollout batch); now at
  most ``EpisodeConfig.max_calls_per_turn`` calls run per turn, the rest are ``not_run``;
- ``run`` with ``timeout: NaN`` (valid to Python's JSON parser and to strict pydantic floats):
  the shell's select raised mid-command and left the command's end record unread; now refused
  as a tool error before anything runs;
- a function-task answer ``{"complex": [10**400, 0]}``: OverflowError out of ``wire.loads``,
  which promises WireError only (the judge caught it as a failed check, so no mask); now a
  WireError (an answer that is not plain data);
- broken calls after ``submit`` in the same message (one a 5,000-digit int): the int crashed the
  parser, so the whole episode was masked and the penalty dodged; now both count as broken;
- defended already, kept as new kinds: NaN and infinities cross the wire as plain floats (a check
  comparing them just fails), and malformed wire documents (bad hex, unhashable keys, two tags,
  unknown tags such as ``__reduce__``) raise WireError.
- defended already: sabotage of the tools' shared shell (``exit``, redefining its end-record
  function, closing its stdout, SIGSTOP) is an ordinary observation; the shell comes back.
"""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest
from test_agent_tools import PLAIN_CHATML, make_repo, open_sandbox

from coderl.agent.episode import EpisodeConfig, SimpleTask
from coderl.agent.parsing import CALL_FORMATS, BrokenCall, parse_hermes, parse_xml
from coderl.agent.runner import run_episode
from coderl.agent.scripted import ScriptedPolicy
from coderl.agent.tools import TOOLS
from coderl.endpoint.calls import parse_reply
from coderl.grading.fncheck import wire
from coderl.policy.tiny import tiny_tokenizer
from coderl.rewards.hacks import detect_hacks

call = CALL_FORMATS["hermes"].format_call
needs_sandbox = pytest.mark.skipif(
    shutil.which("bwrap") is None or os.geteuid() != 0,
    reason="needs bubblewrap and root (make sysdeps); CI has both",
)
HUGE_INT = "7" * 5000  # past Python's 4,300-digit int conversion limit
DEEP = "[" * 1500  # past the JSON parser's recursion limit
NEAR_LIMIT = "[" * 985 + "]" * 985  # parses at a shallow stack, crashes what recurses deeper
BIG_TURNS = EpisodeConfig(
    max_tokens_per_turn=8000,
    max_tokens=40_000,
    context_budget=60_000,
    max_consecutive_broken_calls=5,
)
"""The tiny tokenizer is one token per character: room for a 5,000-digit call in one turn."""


@pytest.fixture(scope="module")
def tok():
    t = tiny_tokenizer()
    t.chat_template = PLAIN_CHATML
    return t


def hermes(arguments: str, name: str = "run") -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def xml(command: str, timeout: str) -> str:
    return (
        f"<tool_call>\n<function=run>\n<parameter=command>\n{command}\n</parameter>\n"
        f"<parameter=timeout>\n{timeout}\n</parameter>\n</function>\n</tool_call>"
    )


HOSTILE_CALLS = {
    "hermes-deep": hermes(DEEP),
    "hermes-deep-closed": hermes("[" * 5000 + "]" * 5000),
    "hermes-huge-int": hermes('{"command": "ls", "timeout": ' + HUGE_INT + "}"),
    "hermes-near-limit": hermes('{"command": ' + NEAR_LIMIT + "}"),
    "xml-deep": xml("ls", DEEP),
    "xml-huge-int": xml("ls", HUGE_INT),
    "xml-near-limit": xml("ls", NEAR_LIMIT),
}


@pytest.mark.parametrize("name", sorted(HOSTILE_CALLS))
def test_hostile_json_in_a_call_is_a_broken_call(name):
    text = HOSTILE_CALLS[name]
    parse = parse_xml if name.startswith("xml") else parse_hermes
    parsed = parse(text, TOOLS)
    assert len(parsed) == 1 and isinstance(parsed[0], BrokenCall)
    assert parsed[0].error  # the model is told what is wrong


@pytest.mark.parametrize("name", ["hermes-deep", "hermes-huge-int", "hermes-near-limit"])
def test_online_server_scores_hostile_json_as_an_invalid_call(name):
    content, calls, status = parse_reply(HOSTILE_CALLS[name], TOOLS, "hermes")
    assert (status, calls) == ("invalid", [])  # scored broken_tool_call, not a 500


@needs_sandbox
def test_hostile_calls_end_as_broken_calls_not_episode_errors(tok, tmp_path):
    script = [
        HOSTILE_CALLS["hermes-deep"],
        HOSTILE_CALLS["hermes-huge-int"],
        HOSTILE_CALLS["hermes-near-limit"],
        call("write_file", {"path": "pkg/ok.py", "content": "x = 1\n"}),
        call("submit", {}),
    ]
    with open_sandbox(make_repo(tmp_path)) as sb:
        ep = run_episode(ScriptedPolicy(tok, script), SimpleTask("t", "fix"), sb, BIG_TURNS)
    assert ep.error is None and ep.failure is None
    assert ep.stats.finish_reason == "submitted"
    assert [c.status for c in ep.tool_calls] == ["broken"] * 3 + ["ok", "ok"]
    assert ep.stats.broken_tool_calls == 3  # the penalty is paid
    assert "pkg/ok.py" in ep.diff

    def deep(n: int) -> list:  # the pipeline runs the detectors well below the stack's top
        return detect_hacks(ep, None, None) if n == 0 else deep(n - 1)

    assert deep(40) == []  # the tool log holds nothing that crashes a reader


@needs_sandbox
def test_run_with_a_nan_timeout_is_refused_and_the_shell_stays_in_step(tok, tmp_path):
    script = [
        hermes('{"command": "sleep 1; echo first", "timeout": NaN}'),
        call("run", {"command": "echo second"}),
        call("submit", {}),
    ]
    with open_sandbox(make_repo(tmp_path)) as sb:
        ep = run_episode(ScriptedPolicy(tok, script), SimpleTask("t", "fix"), sb, EpisodeConfig())
    assert ep.error is None and ep.stats.finish_reason == "submitted"
    first, second, _ = ep.tool_calls
    assert first.status == "tool_error" and "timeout" in first.observation
    assert second.status == "ok"
    assert "second" in second.observation and "first" not in second.observation


@needs_sandbox
def test_broken_calls_after_submit_in_one_message_still_count(tok, tmp_path):
    """Submitting first and then breaking calls in the same message must not dodge the penalty
    (the calls after ``submit`` are not run, but a malformed one is still counted)."""
    text = call("submit", {}) + HOSTILE_CALLS["hermes-huge-int"] + "<tool_call>{oops"
    with open_sandbox(make_repo(tmp_path)) as sb:
        ep = run_episode(ScriptedPolicy(tok, [text]), SimpleTask("t", "fix"), sb, BIG_TURNS)
    assert ep.error is None and ep.stats.finish_reason == "submitted"
    assert [c.status for c in ep.tool_calls] == ["ok", "broken", "broken"]
    assert ep.stats.broken_tool_calls == 2


@pytest.mark.parametrize(
    "doc",
    [
        '{"complex": [' + "1" + "0" * 400 + ", 0]}",
        '{"complex": [0, -' + "9" * 400 + "]}",
        '{"set": [' + HUGE_INT + "]}",
        '{"bytes": "zz"}',
        '{"dict": [[[1], 2]]}',
        '{"set": [{"dict": []}]}',
        "[" * 200 + "]" * 200,
        '{"tuple": [1], "set": [2]}',
        '{"__reduce__": ["os.system", "id"]}',
    ],
)
def test_wire_decoding_raises_only_wire_errors(doc):
    with pytest.raises(wire.WireError):
        wire.loads(doc)


def test_wire_keeps_non_finite_floats_as_plain_values():
    """NaN and infinities cross as floats (a check that compares them simply fails)."""
    value = wire.loads(wire.dumps([math.nan, math.inf, -math.inf]))
    assert math.isnan(value[0]) and value[1:] == [math.inf, -math.inf]
    assert json.loads(wire.dumps(10**4000 // 10**3999)) == 10


@needs_sandbox
def test_one_turn_of_many_reads_cannot_flood_the_next_prompt(tok, tmp_path):
    """40 cheap reads of a big file in one message: each returns up to max_observation_chars,
    so unbounded they would add 40 x 8,000 characters to the summary prompt (past a real
    engine's context length, failing the whole batch). Only ``max_calls_per_turn`` run."""
    base = make_repo(tmp_path)
    (base / "big.txt").write_text("line of text\n" * 5000)
    many = "".join(call("read_file", {"path": "big.txt"}) for _ in range(40))
    cfg = EpisodeConfig(max_tokens_per_turn=4000, context_budget=400_000, max_tokens=40_000)
    with open_sandbox(base) as sb:
        ep = run_episode(
            ScriptedPolicy(tok, [many, call("submit", {})]), SimpleTask("t", "fix"), sb, cfg
        )
    assert ep.error is None and ep.stats.finish_reason == "submitted"
    first_turn = [c for c in ep.tool_calls if c.turn == 1]
    assert len(first_turn) == 40
    assert [c.status for c in first_turn].count("ok") == cfg.max_calls_per_turn
    assert all(c.status == "not_run" for c in first_turn[cfg.max_calls_per_turn :])
    shown = sum(len(c.observation) for c in first_turn)
    assert shown <= cfg.max_calls_per_turn * cfg.tools.max_observation_chars + 40 * 100
    assert ep.stats.broken_tool_calls == 0  # calling too often is not a malformed call


@needs_sandbox
def test_sabotaging_the_tool_shell_is_the_policys_loss_not_a_mask(tok, tmp_path):
    """The policy can wreck the shell the tools share (exit, forge the end-record function,
    close its own stdout, stop itself): each is an ordinary observation, the shell comes back,
    and the episode still ends, with its diff, as a scored one."""
    script = [
        call("run", {"command": "exit 3"}),
        call("run", {"command": "__coderl_done() { :; }", "timeout": 1}),
        call("run", {"command": "exec 1>&- 2>&-"}),
        call("run", {"command": "kill -STOP $$", "timeout": 1}),
        call("write_file", {"path": "pkg/after.py", "content": "z = 3\n"}),
        call("run", {"command": "echo alive"}),
        call("submit", {}),
    ]
    with open_sandbox(make_repo(tmp_path)) as sb:
        ep = run_episode(ScriptedPolicy(tok, script), SimpleTask("t", "fix"), sb, EpisodeConfig())
    assert ep.error is None and ep.failure is None
    assert ep.stats.finish_reason == "submitted" and ep.stats.broken_tool_calls == 0
    assert "exit code 3" in ep.tool_calls[0].observation
    assert "timed out" in ep.tool_calls[1].observation  # its own end record never came
    assert "alive" in ep.tool_calls[5].observation
    assert "pkg/after.py" in ep.diff
