"""Agent tools, tool-call parsing, observation truncation and prompt rendering."""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import pytest
from transformers.utils.chat_template_utils import DocstringParsingException

from coderl.agent.context import template_supports_tools
from coderl.agent.episode import EpisodeConfig, SimpleTask
from coderl.agent.parsing import (
    CALL_FORMATS,
    BrokenCall,
    ToolCall,
    ValidCall,
    get_call_format,
    validate,
)
from coderl.agent.runner import run_episode
from coderl.agent.scripted import ScriptedPolicy
from coderl.agent.tools import (
    TOOLS,
    TOOLSETS,
    ToolConfig,
    ToolContext,
    execute,
    make_tool,
    resolve_tools,
    truncate_middle,
)
from coderl.policy.tiny import tiny_tokenizer
from coderl.sandbox import Sandbox
from coderl.sandbox.local import UnisolatedSandboxWarning
from coderl.tasks.spec import Task

# SmolLM2-135M-Instruct's GGUF chat template: plain ChatML that ignores ``tools=``.
PLAIN_CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def open_sandbox(base: Path) -> Sandbox:
    """A real sandbox over ``base``: bubblewrap where it can run, else the unisolated local
    backend (hosts without root; its warning is expected here)."""
    if os.geteuid() == 0 and shutil.which("bwrap"):
        return Sandbox.create(base)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnisolatedSandboxWarning)
        return Sandbox.create(base, backend="local")


def make_repo(tmp_path: Path) -> Path:
    base = tmp_path / "base"
    (base / "pkg").mkdir(parents=True)
    (base / "pkg" / "calc.py").write_text(
        "def add(a, b):\n    return a - b\n\n\ndef sub(a, b):\n    return a - b\n"
    )
    (base / "test_calc.py").write_text(
        "from pkg.calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"
    )
    return base


@pytest.fixture
def ctx(tmp_path: Path):
    with open_sandbox(make_repo(tmp_path)) as sandbox:
        yield ToolContext(sandbox)


def call(ctx: ToolContext, name: str, **arguments) -> tuple[str, bool]:
    checked = validate(ToolCall(name, arguments, ""), TOOLS)
    assert isinstance(checked, ValidCall), checked
    outcome = execute(checked.tool, checked.arguments, ctx)
    return outcome.observation, outcome.ok


# --- schemas ---------------------------------------------------------------------------------


def test_schemas_come_from_signatures_and_docstrings():
    fn = TOOLS["read_file"].schema["function"]
    assert fn["name"] == "read_file"
    assert fn["description"] == "Read a text file from the workspace, with line numbers."
    props = fn["parameters"]["properties"]
    assert list(props) == ["path", "start_line", "end_line"]  # the context parameter is hidden
    assert props["start_line"]["type"] == "integer"
    assert fn["parameters"]["required"] == ["path"]
    assert (
        TOOLS["run"].schema["function"]["parameters"]["properties"]["timeout"]["type"] == "number"
    )
    assert TOOLS["submit"].schema["function"]["parameters"]["properties"] == {}


def test_custom_tool_needs_documented_arguments():
    def shout(ctx: ToolContext, text: str) -> str:
        """Shout.

        Args:
            text: What to shout.
        """
        return text.upper()

    assert make_tool(shout).schema["function"]["parameters"]["required"] == ["text"]

    def mumble(ctx: ToolContext, text: str) -> str:
        """Mumble, with no Args section."""
        return text

    with pytest.raises(DocstringParsingException, match="text"):
        make_tool(mumble)


def test_tool_sets_and_formats_reject_unknown_names():
    assert list(resolve_tools(TOOLSETS["function"])) == list(TOOLSETS["function"])
    with pytest.raises(KeyError, match="valid tools"):
        resolve_tools(["read_file", "teleport", "submit"])
    with pytest.raises(KeyError, match="submit"):
        resolve_tools(["read_file"])
    with pytest.raises(KeyError, match="hermes"):
        get_call_format("yaml")


# --- observation truncation ------------------------------------------------------------------


def test_truncate_middle_keeps_head_and_tail():
    # 10 characters into 4: head 2 ("ab"), tail 2 ("ij"), 6 omitted.
    assert truncate_middle("abcdefghij", 4) == "ab\n[... 6 characters omitted ...]\nij"
    assert truncate_middle("abc", 3) == "abc"
    # odd budget: head 5 // 2 = 2, tail 3.
    assert truncate_middle("0123456789", 5) == "01\n[... 5 characters omitted ...]\n789"
    with pytest.raises(ValueError):
        truncate_middle("x", 0)


def test_long_observations_are_truncated(ctx):
    ctx.config = ToolConfig(max_observation_chars=60)
    obs, ok = call(ctx, "run", command="python3 -c \"print('x' * 500)\"")
    assert ok and len(obs) < 120 and "characters omitted" in obs and obs.startswith("exit code 0")


# --- the tools -------------------------------------------------------------------------------


def test_read_file_numbers_lines_and_checks_ranges(ctx):
    obs, ok = call(ctx, "read_file", path="pkg/calc.py", start_line=4, end_line=5)
    assert ok and obs == "     4\t\n     5\tdef sub(a, b):"
    obs, ok = call(ctx, "read_file", path="pkg/calc.py", start_line=9)
    assert not ok and "lines 1..6" in obs
    obs, ok = call(ctx, "read_file", path="missing.py")
    assert not ok and obs.startswith("Error: FileNotFoundError")


def test_edit_with_two_matches_errors_and_changes_nothing(ctx):
    before = ctx.sandbox.read_text("pkg/calc.py")
    obs, ok = call(ctx, "edit", path="pkg/calc.py", old="return a - b", new="return a + b")
    assert not ok
    assert "occurs 2 times" in obs and "lines 2, 6" in obs and "Nothing was changed" in obs
    assert ctx.sandbox.read_text("pkg/calc.py") == before


def test_edit_unique_match_replaces_it(ctx):
    obs, ok = call(
        ctx,
        "edit",
        path="pkg/calc.py",
        old="add(a, b):\n    return a - b",
        new="add(a, b):\n    return a + b",
    )
    assert ok and "     2\t    return a + b" in obs
    assert ctx.sandbox.read_text("pkg/calc.py").startswith("def add(a, b):\n    return a + b\n")
    obs, ok = call(ctx, "edit", path="pkg/calc.py", old="nowhere", new="x")
    assert not ok and "not found" in obs


def test_search_run_write_submit(ctx):
    obs, ok = call(ctx, "search", pattern="def (add|sub)")
    assert ok and obs.splitlines() == [
        "./pkg/calc.py:1:def add(a, b):",
        "./pkg/calc.py:5:def sub(a, b):",
    ]
    ctx.config = ToolConfig(search_max_results=1)
    obs, _ = call(ctx, "search", pattern="a - b", path="pkg")
    assert obs.splitlines()[1] == "[... 1 more matching lines not shown; narrow the search ...]"
    obs, ok = call(ctx, "search", pattern="zzz_nothing")
    assert ok and obs.startswith("No matches")
    obs, ok = call(ctx, "write_file", path="notes/a.txt", content="one\ntwo\n")
    assert ok and obs == "Wrote 2 lines to notes/a.txt."
    obs, ok = call(ctx, "run", command="cat notes/a.txt; echo oops >&2; exit 3")
    assert ok and obs == "exit code 3\nstdout:\none\ntwo\nstderr:\noops"
    obs, _ = call(ctx, "run", command="sleep 5", timeout=0.2)
    assert obs.startswith("timed out after 0.2 s")
    assert not ctx.submitted
    assert call(ctx, "submit") == ("Submitted.", True) and ctx.submitted


def test_bad_tool_input_is_an_error_observation(ctx):
    obs, ok = call(ctx, "search", pattern="(unclosed")
    assert not ok and obs.startswith("Error: search failed:")
    obs, ok = call(ctx, "run", command="true", timeout=0)
    assert not ok and obs == "Error: timeout must be positive, got 0.0"
    obs, ok = call(ctx, "edit", path="pkg/calc.py", old="", new="x")
    assert not ok and "old must not be empty" in obs


# --- parsing ---------------------------------------------------------------------------------


def test_hermes_parses_calls_in_order_and_reports_broken_ones():
    text = (
        'Let me look.\n<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n'
        "</tool_call>\n<tool_call>{not json}</tool_call>"
        '<tool_call>{"name": "run"}</tool_call>'
        '<tool_call>{"name": "run", "arguments": "ls"}</tool_call>'
        "</tool_call><tool_call>"
        '{"name": "submit", "arguments": {}}'
    )
    calls = CALL_FORMATS["hermes"].parse(text, TOOLS)
    assert calls[0] == ToolCall("read_file", {"path": "a.py"}, calls[0].text)
    assert [type(c) for c in calls] == [ToolCall] + [BrokenCall] * 5
    errors = [c.error for c in calls[1:]]
    assert "not valid JSON" in errors[0]
    assert "got ['name']" in errors[1]  # arguments missing
    assert '"arguments" an object' in errors[2]
    assert "without a matching <tool_call>" in errors[3]
    assert "not closed" in errors[4]  # the unterminated last block is reported, not run
    assert CALL_FORMATS["hermes"].parse("Just text, no calls.", TOOLS) == []


def test_xml_format_reads_typed_values():
    text = (
        "<tool_call>\n<function=read_file>\n<parameter=path>\na.py\n</parameter>\n"
        "<parameter=start_line>\n3\n</parameter>\n</function>\n</tool_call>"
    )
    (c,) = CALL_FORMATS["xml"].parse(text, TOOLS)
    assert c == ToolCall("read_file", {"path": "a.py", "start_line": 3}, c.text)
    (bad,) = CALL_FORMATS["xml"].parse("<tool_call><function=x>junk</function></tool_call>", TOOLS)
    assert isinstance(bad, BrokenCall) and "outside <parameter>" in bad.error


@pytest.mark.parametrize("fmt", sorted(CALL_FORMATS))
def test_format_call_parses_back(fmt):
    args = {"path": "src/a b.py", "old": 'x = "1"\n\tif y:\n', "new": "{}\\n"}
    (c,) = CALL_FORMATS[fmt].parse(CALL_FORMATS[fmt].format_call("edit", args), TOOLS)
    assert isinstance(c, ToolCall) and (c.name, c.arguments) == ("edit", args)


def test_validation_rejects_unknown_tools_and_bad_arguments():
    unknown = validate(ToolCall("teleport", {}, "t"), TOOLS)
    assert isinstance(unknown, BrokenCall) and "unknown tool 'teleport'" in unknown.error
    bad = validate(ToolCall("read_file", {"path": 1, "start_line": "2", "x": 0}, ""), TOOLS)
    assert isinstance(bad, BrokenCall)
    assert (
        "'path'" in bad.error
        and "'start_line'" in bad.error
        and "unexpected argument 'x'" in bad.error
    )
    missing = validate(ToolCall("edit", {"path": "a"}, ""), TOOLS)
    assert "missing required argument 'old'" in missing.error  # type: ignore[union-attr]
    ok = validate(ToolCall("read_file", {"path": "a"}, ""), TOOLS)
    assert isinstance(ok, ValidCall) and ok.arguments == {
        "path": "a",
        "start_line": None,
        "end_line": None,
    }


# --- prompt rendering ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizers():
    native = tiny_tokenizer()
    plain = tiny_tokenizer()
    plain.chat_template = PLAIN_CHATML
    return native, plain


class _Rejects:
    """A tokenizer whose chat template raises ``error`` when given tools."""

    chat_template = "{{ messages }}"

    def __init__(self, error: Exception) -> None:
        self.error = error

    def apply_chat_template(self, *args, **kwargs):
        raise self.error


def test_only_a_template_that_rejects_tools_reads_as_no_tool_support():
    """What a template raises when it rejects ``tools=`` (``TEMPLATE_FAULTS``) means no support;
    any other error is a bug (here the tokenizer's) and is raised, not read as "no tools"."""
    import jinja2

    for error in (jinja2.TemplateError("tools are not supported"), TypeError("no tools kwarg")):
        assert not template_supports_tools(_Rejects(error))
    with pytest.raises(RuntimeError, match="the tokenizer's own bug"):
        template_supports_tools(_Rejects(RuntimeError("the tokenizer's own bug")))


def test_tools_reach_the_rendered_prompt(tokenizers, tmp_path):
    native, plain = tokenizers
    assert template_supports_tools(native) and not template_supports_tools(plain)
    # a task layer Task of kind "function" gets the "function" tool set (no search)
    task = Task(
        id="t/0",
        kind="function",
        env_id="python3",
        problem_statement="Fix add().",
        FAIL_TO_PASS=["test_calc.py::test_add"],
        gold_patch="-",
        source="test",
        license="MIT",
    )
    base = make_repo(tmp_path)
    submit = CALL_FORMATS["hermes"].format_call("submit", {})
    cfg = EpisodeConfig(instructions="You fix bugs.")
    for name, tok in (("native", native), ("plain", plain)):
        policy = ScriptedPolicy(tok, [submit])
        with open_sandbox(base) as sandbox:
            run_episode(policy, task, sandbox, cfg)
        text = tok.decode(policy.prompts[0])  # what the model was given, from the token ids
        assert text.startswith("<|im_start|>system\nYou fix bugs.")
        assert text.endswith("<|im_start|>user\nFix add().<|im_end|>\n<|im_start|>assistant\n")
        for tool in TOOLSETS["function"]:
            assert json.dumps(TOOLS[tool].schema) in text
        assert "search" not in text  # not in the "function" tool set
        assert "<tool_call>" in text and "</tool_call>" in text  # the call format is shown
        # the plain template gets coderl's own tools section, the native one its template's
        assert ("You can call these tools" in text) == (name == "plain")
    with pytest.raises(KeyError, match="no tool set for task kind 'quiz'"):
        run_episode(ScriptedPolicy(plain, []), SimpleTask("q", "?", kind="quiz"), None, cfg)  # type: ignore[arg-type]
