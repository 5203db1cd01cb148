"""Malformed completions and hostile workspace states end as ordinary episodes, never as errors.

An episode that ends with ``error`` is masked, so anything the policy can write that crashes the
harness would turn a bad sample into no sample (issue 19, classes 6 and 8). Covered: lone
surrogates in tool-call arguments, argument names and tool names (valid JSON escapes), file
names that are not UTF-8, a directory 1,100 levels deep, and grading such workspaces.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from test_agent_tools import PLAIN_CHATML, make_repo, open_sandbox

from coderl.agent.episode import EpisodeConfig, SimpleTask
from coderl.agent.parsing import CALL_FORMATS, printable
from coderl.agent.runner import run_episode
from coderl.agent.scripted import ScriptedPolicy
from coderl.policy.tiny import tiny_tokenizer
from coderl.sandbox import workspace
from coderl.sandbox.base import DIFF_EXCLUDES

call = CALL_FORMATS["hermes"].format_call
needs_sandbox = pytest.mark.skipif(
    shutil.which("bwrap") is None or os.geteuid() != 0,
    reason="needs bubblewrap and root (make sysdeps); CI has both",
)


@pytest.fixture(scope="module")
def tok():
    t = tiny_tokenizer()
    t.chat_template = PLAIN_CHATML
    return t


def raw(name: str, arguments: str) -> str:
    """A hermes call with its JSON written by hand (``format_call`` cannot emit a lone
    surrogate: ``json.dumps`` escapes it, which is exactly what a model may write)."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def test_printable_escapes_lone_surrogates_only():
    assert printable("plain é ✓") == "plain é ✓"
    assert printable("a\ud800b\udcffc") == "a\\ud800b\\udcffc"
    printable("a\ud800").encode("utf-8")  # now encodable


def test_lone_surrogates_in_calls_are_broken_calls_not_episode_errors(tok, tmp_path):
    with pytest.raises(TypeError):  # the premise: the tokenizer refuses a lone surrogate
        tok.encode("\ud800")
    script = [
        raw("write_file", '{"path": "pkg/x\\ud800.py", "content": "a = 1\\n"}'),
        raw("write_file", '{"path": "pkg/y.py", "content": "a = \'\\ud800\'\\n"}'),
        raw("write_file", '{"path": "pkg/y.py", "content": "a", "\\ud800": 1}'),
        raw("r\\ud800n", '{"command": "ls"}'),
        raw("run", '{"command": "echo \\udc80"}'),
        raw(
            "edit",
            '{"path": "pkg/calc.py", "old": "a - b\\n\\n\\n", "new": "a + b\\ud800\\n\\n\\n"}',
        ),
        raw("search", '{"pattern": "\\ud800", "path": "."}'),
        call("submit", {}),
    ]
    with open_sandbox(make_repo(tmp_path)) as sb:
        cfg = EpisodeConfig(max_consecutive_broken_calls=99)
        ep = run_episode(ScriptedPolicy(tok, script), SimpleTask("t", "fix"), sb, cfg)
    assert ep.error is None and ep.stats.finish_reason == "submitted"
    statuses = [c.status for c in ep.tool_calls]
    # not UTF-8 text: broken where the parser builds the call (a scored penalty), never run
    assert statuses == ["broken"] * 7 + ["ok"]
    assert all("lone surrogate" in c.observation for i, c in enumerate(ep.tool_calls[:7]) if i != 3)
    assert "r\\\\ud800n" in ep.tool_calls[3].observation  # its escape, in the name's repr
    for c in ep.tool_calls:
        c.observation.encode("utf-8")
        # names and arguments too: made encodable where the parser built the call
        json.dumps([c.name, c.arguments], ensure_ascii=False).encode("utf-8")
    assert ep.diff == ""  # nothing was written


def _hostile_tree(root: Path, depth: int) -> None:
    """A file whose name is not UTF-8 and a file ``depth`` directories down."""
    with open(os.path.join(os.fsencode(root), b"bad\xff.py"), "wb") as f:
        f.write(b"x = 1\n")
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(depth):  # relative to fds: the path is longer than PATH_MAX
        os.mkdir("d", dir_fd=fd)
        nxt = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = nxt
    with open(os.open("deep.txt", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd), "w") as f:
        f.write("deep\n")
    os.close(fd)


def test_tree_diff_and_removal_survive_non_utf8_names_and_1100_levels(tmp_path):
    base, tree = tmp_path / "base", tmp_path / "tree"
    base.mkdir()
    tree.mkdir()
    _hostile_tree(tree, 1100)
    diff = workspace.tree_diff(base, tree, DIFF_EXCLUDES)
    assert 'diff --git "a/bad\\377.py" "b/bad\\377.py"' in diff  # quoted the way git writes it
    assert os.fsencode("bad\udcff.py") == b"bad\xff.py"
    assert "deep.txt" not in diff  # past MAX_DEPTH: left out, not a crash
    with pytest.raises(RecursionError):  # the premise: the standard library's rmtree recurses
        shutil.rmtree(tree)
    os.chmod(tree / "d", 0)  # a sandbox may leave a directory without permissions
    workspace.remove_tree(tree)
    assert not tree.exists()


def test_shallow_trees_still_diff_every_level(tmp_path):
    base, tree = tmp_path / "base", tmp_path / "tree"
    (base / "a" / "b").mkdir(parents=True)
    (base / "a" / "b" / "gone.txt").write_text("old\n")
    nested = tree / Path(*["n"] * (workspace.MAX_DEPTH - 1))
    nested.mkdir(parents=True)
    (nested / "at_the_limit.txt").write_text("new\n")
    diff = workspace.tree_diff(base, tree, DIFF_EXCLUDES)
    assert "at_the_limit.txt" in diff and "deleted file mode 100644" in diff


@needs_sandbox
def test_hostile_workspace_does_not_crash_tools_diff_or_grading(tok, tmp_path):
    from coderl.grading.function import workspace_base
    from coderl.grading.grade import grade
    from coderl.tasks.humaneval import humaneval_tasks

    task = {t.id: t for t in humaneval_tasks("all")}["HumanEval/0"]
    make_tree = (
        "printf 'x = 1\\n' > \"$(printf 'bad\\377.py')\" && mkdir -p deep && cd deep && "
        "for i in $(seq 1100); do mkdir d && cd d || break; done; echo deep > deep.txt"
    )
    script = [
        call("run", {"command": make_tree}),
        call("run", {"command": "ls"}),
        call("read_file", {"path": "bad\ufffd.py"}),
        call("search", {"pattern": "deep"}),
        call("write_file", {"path": "solution.py", "content": "def f(:\n"}),
        call("submit", {}),
    ]
    from coderl.sandbox import Sandbox

    task_view = SimpleTask(task.id, task.problem_statement, kind="function")
    with Sandbox.create(workspace_base(task)) as sb:
        ep = run_episode(ScriptedPolicy(tok, script), task_view, sb, EpisodeConfig())
    assert ep.error is None and ep.stats.finish_reason == "submitted", ep.error
    assert [c.status for c in ep.tool_calls][:2] == ["ok", "ok"]
    assert '"b/bad\\377.py"' in ep.diff and "deep.txt" not in ep.diff
    result = grade(task, ep.diff)
    assert result.grading_error is None and not result.resolved, result.reason


# --- every policy-controlled string is encodable from the parser on (issue 47, class 6) -------

SURROGATE_CALLS = [
    ("hermes", raw("run", '{"\\udc80": "x"}')),
    ("hermes", raw("run", '{"command": ["a", {"b": "\\ud800"}]}')),
    ("hermes", raw("write_file", '{"path": "a.py", "content": "\\udfff"}')),
    ("hermes", raw("run", '{"command": {"\\ud9ff": 1}}')),
]


@pytest.mark.parametrize(("fmt", "text"), SURROGATE_CALLS)
def test_a_call_whose_arguments_are_not_text_is_broken_at_the_parser(fmt, text):
    from coderl.agent.parsing import BrokenCall, ToolCall
    from coderl.agent.tools import TOOLS

    (parsed,) = CALL_FORMATS[fmt].parse(text, TOOLS)
    assert isinstance(parsed, BrokenCall) and "lone surrogate" in parsed.error
    (named,) = CALL_FORMATS["hermes"].parse(raw("\\ud800", "{}"), TOOLS)
    assert isinstance(named, ToolCall) and named.name == "\\ud800"  # escaped: encodable


def test_input_hash_is_total_and_keeps_the_keys_of_valid_text():
    import hashlib

    from coderl.graders.cache import input_hash

    plain = ["plain \u00e9 \u2713", {"k": 1}]
    blob = json.dumps(plain, sort_keys=True, ensure_ascii=False).encode("utf-8")
    assert input_hash(plain) == hashlib.sha256(blob).hexdigest()  # existing caches still hit
    assert input_hash(["\ud800"]) != input_hash(["\udc00"])  # hashes, does not raise


@pytest.mark.parametrize("gate", [True, False])
def test_a_surrogate_tool_name_is_scored_by_a_learned_term_not_masked(tok, gate):
    """A13: ``{"name": "\\ud800"}`` in the tool log reached the judge term's input hash, whose
    UnicodeEncodeError made the term fail and the sample a mask (``total=nan``)."""
    from coderl.config import load_config
    from coderl.envs.agent import AgentEnvironment
    from coderl.policy.base import SamplingParams
    from coderl.rewards import compute_rewards
    from coderl.tasks.humaneval import humaneval_tasks
    from coderl.train.pipeline import attribute, reward_samples

    task = humaneval_tasks("train")[0]
    overrides = [
        "rollout.max_turns=3", "rollout.max_new_tokens=8192", "rollout.max_context_tokens=32768",
        'reward.terms={"tests": 1.0, "broken_calls": 1.0, "judge": 0.3}',
        "reward.judge.model=tiny-random", "reward.judge.cache=null",
        f"reward.learned_requires_tests={str(gate).lower()}",
    ]  # fmt: skip
    cfg = load_config(None, overrides)
    env = AgentEnvironment(cfg, humaneval_tasks)
    script = [raw("\\ud800", "{}"), call("submit", {})]
    eps = env.rollout(ScriptedPolicy(tok, script), [task], SamplingParams(), 1)
    grades = env.grade([task], eps)
    fails = [attribute(e, g) for e, g in zip(eps, grades, strict=True)]
    res = compute_rewards(reward_samples(env, [task], ["k"], eps, grades, fails), cfg.reward)
    assert eps[0].broken_tool_calls == 1 and res.valid[0] and res.errors == []


@pytest.mark.parametrize("byproducts", [1, 5])
def test_the_diff_compares_a_bounded_amount_of_text_smallest_changes_first(
    tmp_path, monkeypatch, byproducts
):
    """Large byproducts past ``MAX_DIFF_TEXT_BYTES`` are noted like binary files (dropped by the
    grader), while the small fix beside them, even sorted after them, is still diffed."""
    monkeypatch.setattr(workspace, "MAX_DIFF_TEXT_BYTES", 4096)
    base, tree = tmp_path / "base", tmp_path / "tree"
    base.mkdir()
    (base / "zz_fix.py").write_text("def add(a, b):\n    return a - b\n")
    shutil.copytree(base, tree)
    (tree / "zz_fix.py").write_text("def add(a, b):\n    return a + b\n")
    for i in range(byproducts):
        (tree / f"a_log{i}.txt").write_text("line\n" * 2000)  # 10,000 bytes each
    diff = workspace.tree_diff(base, tree, DIFF_EXCLUDES)
    assert "+    return a + b\n" in diff
    assert diff.count("Binary files /dev/null and b/a_log") == byproducts
    assert len(diff) < 2000
