"""The repository ladder (coderl.tasks.ladder): every level's statement keeps its promise and
never names a held-out test, for every shipped task; the oracle demonstrates every level and
its replays resolve in a fresh grading sandbox; the tools keep a read to a window.

The statement checks run on every shipped task without an environment (the L0 line is checked
against the bug patch, which is independent of the gold patch the statement reads). The checks
that need the environment (the held-out tests' source, the workspace's line, the replays) run
on the shipped tasks of six, the library CI builds for the grading suites.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

from coderl.tasks.ladder import (
    LEVELS,
    bug_site,
    change_blocks,
    ladder_statement,
    ladder_task,
    ladder_tasks,
    level_of,
)
from coderl.tasks.spec import Task, load_tasks
from coderl.tasks.statement import held_out_mentions

ROOT = Path(__file__).parent.parent
TASK_FILES = sorted((ROOT / "data" / "tasks").glob("*.jsonl.gz"))
SHIPPED = [t for p in TASK_FILES for t in load_tasks(p)]
CI_SPEC = "six==1.17.0"

needs_sandbox = pytest.mark.skipif(
    shutil.which("bwrap") is None or os.geteuid() != 0,
    reason="needs bubblewrap and root (make sysdeps); CI has both",
)


def _bug_lines(task: Task) -> tuple[str, int, list[str]]:
    """``(path, first line, lines)`` of the bug as the *bug patch* puts it in the starting
    state (its ``+`` side): the check of the L0 line, independent of the gold patch."""
    (path, line, added), hunk_line = ("", 0, []), 0
    for text in task.bug_patch.splitlines():
        if text.startswith("+++ "):
            path = text[4:].removeprefix("b/")
        elif m := re.match(r"^@@ -\d+(?:,\d+)? \+(\d+)", text):
            hunk_line = int(m.group(1))
        elif text.startswith("+"):
            line = line or hunk_line
            added.append(text[1:])
            hunk_line += 1
        elif text.startswith(" "):
            if added:
                break
            hunk_line += 1
    return path, line, added


def test_every_shipped_task_has_every_level_and_no_statement_names_a_held_out_test():
    variants = ladder_tasks(SHIPPED, LEVELS)
    assert len(variants) == len(LEVELS) * len(SHIPPED)  # every shipped fix is one edit
    for v in variants:
        assert not held_out_mentions(v.problem_statement, v.held_out_tests), v.id
        assert v.id.endswith(f"@L{level_of(v)}") and v.extra["ladder"]["of"] in v.id
    by_id = {t.id: t for t in SHIPPED}
    for v in variants:  # the same task otherwise: graded the same way
        t = by_id[v.extra["ladder"]["of"]]
        keep = (
            "env_id",
            "FAIL_TO_PASS",
            "PASS_TO_PASS",
            "held_out_tests",
            "bug_patch",
            "gold_patch",
        )
        assert all(getattr(v, k) == getattr(t, k) for k in keep), v.id


def test_l0_names_the_file_and_line_of_the_bug_for_every_shipped_task():
    for t in SHIPPED:
        path, line, bug = _bug_lines(t)
        s0 = ladder_statement(t, 0)
        assert f'File "{path}", line {line}\n' in s0, t.id
        for text in bug:
            assert f"    {text.strip()}" in s0
        assert f"The bug is in {path}." in ladder_statement(t, 1)
        for level in (1, 2):  # the file (L1) but never the line; L2 not the file either
            s = ladder_statement(t, level)
            assert f"line {line}" not in s.split("```")[-1]
        assert path not in ladder_statement(t, 2).split("```")[-1]
        assert ladder_statement(t, 3) == t.problem_statement


def test_the_level_statement_shows_one_visible_failing_test_when_there_is_one():
    for t in SHIPPED[:80]:
        s = ladder_statement(t, 2)
        named = re.findall(r"^Failing test: (\S+)$", s, re.M)
        visible = set(t.FAIL_TO_PASS) - set(t.held_out_tests)
        assert len(named) <= 1 and set(named) <= visible
        assert bool(named) or "held out" in s


def test_change_blocks_read_the_starting_state_lines_of_the_gold_patch():
    gold = (
        "--- a/m.py\n+++ b/m.py\n@@ -10,4 +10,5 @@\n a\n-b\n-c\n+B\n+C\n+D\n d\n"
        "@@ -30,2 +31,3 @@\n x\n+y\n z\n"
    )
    assert [(s.path, s.line, s.old) for s in change_blocks(gold)] == [
        ("m.py", 11, ("b", "c")),
        ("m.py", 31, ()),  # an insertion: before line 31 of the starting state
    ]
    two = Task.model_validate({**SHIPPED[0].model_dump(), "gold_patch": gold})
    assert bug_site(two) is None
    with pytest.raises(ValueError, match="one-edit"):
        ladder_statement(two, 0)
    assert [level_of(v) for v in ladder_tasks([two], [0, 1, 2])] == [1, 2]  # no L0 for it
    with pytest.raises(ValueError, match="unknown levels"):
        ladder_tasks([two], [4])


def test_a_variant_that_would_quote_held_out_source_is_refused():
    """The check is wired in: a line of the quoted test output, passed as held-out source,
    refuses the variant (a held-out test with that code would be revealed); the library line
    L0 quotes is the workspace's own code and does not."""
    t = next(t for t in SHIPPED if "Output of " in t.problem_statement)
    s2 = ladder_statement(t, 2)
    body = s2.split("```")[1].splitlines()
    line = next(ln.strip() for ln in body if len(ln.strip()) >= 12)
    with pytest.raises(ValueError, match="reveals held-out"):
        ladder_task(t, 2, [line])
    site = bug_site(t)
    assert site is not None and len(site.old[0].strip()) >= 1
    ladder_task(t, 0, [site.old[0]])  # the quoted library line: allowed


def test_a_config_selects_levels_through_tasks_options_ladder():
    from coderl.config import load_config
    from coderl.envs import build_environment

    cfg = load_config(ROOT / "configs" / "repo-ladder.yaml")
    env = build_environment(cfg)
    labels = [m.label() for m in cfg.tasks.mix]
    assert labels == ["repo-L0", "repo-L1", "repo-L2", "repo-L3"]
    assert cfg.tasks.curriculum is not None and cfg.tasks.curriculum.order == labels
    for k, label in enumerate(labels):
        train = env.source_tasks(label, cfg.tasks.train_split)
        assert train and {level_of(t) for t in train} == {k}
    heldout = env.tasks(cfg.tasks.heldout_split)[: cfg.eval.tasks]
    assert {level_of(t) for t in heldout} == set(LEVELS)  # the evaluated prefix has every level


# --- with the environment ----------------------------------------------------------------


@pytest.fixture(scope="module")
def six_tasks():
    from coderl.envbuild.build import build_env

    build_env(CI_SPEC)
    return [t for t in SHIPPED if t.id.startswith("six-")]


@needs_sandbox
def test_statements_quote_no_held_out_source_and_l0_points_at_the_workspace_line(six_tasks):
    """Every shipped task whose environment is built here (six always: the fixture builds it;
    in CI also the libraries the oracle replays build): no level quotes a held-out test's
    source; the L0 line is the workspace's (every six task, the first task of each other
    library: materialising a workspace costs a copy)."""
    from coderl.grading.grade import rollout_base
    from coderl.tasks.env import find_env
    from coderl.tasks.holdout import held_out_source

    checked: set[str] = set()
    for t in SHIPPED:
        try:
            env = find_env(t.env_id)
        except KeyError:
            continue  # not built on this machine
        source = held_out_source(Path(env.snapshot), t.held_out_tests)
        for level in LEVELS:
            ladder_task(t, level, source)  # raises if it names or quotes a held-out test
        if env.name != "six" and env.name in checked:
            continue
        checked.add(env.name)
        site = bug_site(t)
        assert site is not None
        lines = (rollout_base(t, env) / site.path).read_text(encoding="utf-8").splitlines()
        assert tuple(lines[site.line - 1 : site.line - 1 + len(site.old)]) == site.old
    assert "six" in checked


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from transformers import AutoTokenizer

    from coderl.policy.loading import smollm2_gguf_path

    path = smollm2_gguf_path()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)


def _episode_config():
    from coderl.agent.episode import EpisodeConfig
    from coderl.config import load_config

    cfg = load_config(ROOT / "configs" / "repo-ladder.yaml")
    ep = cfg.tasks.mix[0].options["episode"]
    return EpisodeConfig(
        max_turns=cfg.rollout.max_turns,
        max_tokens=cfg.rollout.max_turns * cfg.rollout.max_new_tokens,
        max_tokens_per_turn=cfg.rollout.max_new_tokens,
        context_budget=cfg.rollout.max_context_tokens,
        **ep,
    )


@needs_sandbox
def test_the_oracle_resolves_every_level_on_the_paths_each_level_promises(
    six_tasks, smollm2_tokenizer
):
    """One six task with a visible failing test, at every level: the oracle's episode runs
    through the harness (template, parser, tools with the preset's read window, sandbox) and its
    diff resolves the task in a fresh grading sandbox; L0 takes read, edit, (run,) submit; L2
    searches, reads, edits, runs the visible test and submits."""
    from concurrent.futures import ThreadPoolExecutor

    from coderl.agent.oracle import oracle_episodes
    from coderl.grading.grade import grade
    from coderl.train.sft import clean_oracle_episode

    base = next(t for t in six_tasks if "Output of " in t.problem_statement)
    variants = [ladder_task(base, lv) for lv in LEVELS]
    episodes = oracle_episodes(smollm2_tokenizer, variants, _episode_config(), max_workers=4)
    with ThreadPoolExecutor(4) as pool:
        grades = list(
            pool.map(lambda p: grade(p[0], p[1].diff), zip(variants, episodes, strict=True))
        )
    for v, ep, g in zip(variants, episodes, grades, strict=True):
        assert g.resolved and clean_oracle_episode(ep), (v.id, ep.stats.finish_reason)
    tools = [[r.name for r in ep.tool_calls] for ep in episodes]
    assert tools[0][0] == "read_file" and tools[0][1] == "edit" and tools[0][-1] == "submit"
    assert len(tools[0]) <= 4
    assert tools[1][:2] == ["search", "read_file"] and "run" in tools[1]
    assert {"search", "read_file", "edit", "run", "submit"} <= set(tools[2])
    assert tools[2].index("run", tools[2].index("edit")) > tools[2].index("edit")


@needs_sandbox
def test_oracle_paths_vary_with_the_seed_at_every_level(six_tasks):
    from coderl.agent.oracle import plan_episode
    from coderl.grading.grade import rollout_base

    shapes: dict[int, set] = {lv: set() for lv in LEVELS}
    for t in six_tasks[:6]:
        base = rollout_base(t)
        for lv in LEVELS:
            v = ladder_task(t, lv)
            for seed in range(4):
                plan = plan_episode(v, base, seed)
                shapes[lv].add(
                    tuple((a.tool, tuple(sorted(a.arguments.items()))) for a in plan.actions)
                )
    assert all(len(s) >= 2 for s in shapes.values()), {k: len(s) for k, s in shapes.items()}


class _Files:
    """A sandbox that only reads files (what ``read_file`` and ``edit`` use of one)."""

    def __init__(self, files: dict[str, str]) -> None:
        self.files = files

    def read_text(self, path: str) -> str:
        return self.files[path]

    def write_text(self, path: str, text: str) -> None:
        self.files[path] = text


def test_read_file_shows_a_window_and_edit_refuses_zero_or_several_matches():
    from coderl.agent.episode import EpisodeConfig
    from coderl.agent.tools import TOOLS, ToolConfig, ToolContext, execute

    text = "".join(f"line {i}\n" for i in range(1, 101))
    ctx = ToolContext(_Files({"m.py": text}), ToolConfig(max_read_lines=10))
    whole = execute(TOOLS["read_file"], {"path": "m.py"}, ctx).observation
    assert "line 10\n" in whole and "line 11\n" not in whole
    assert "showing lines 1..10 of 100" in whole
    window = execute(TOOLS["read_file"], {"path": "m.py", "start_line": 50, "end_line": 52}, ctx)
    assert (
        window.observation.splitlines()[0].endswith("line 50")
        and "showing" not in window.observation
    )
    none = execute(TOOLS["edit"], {"path": "m.py", "old": "nothing", "new": "x"}, ctx)
    many = execute(TOOLS["edit"], {"path": "m.py", "old": "line 1", "new": "x"}, ctx)
    assert not none.ok and "not found" in none.observation
    assert (
        not many.ok and "occurs" in many.observation and "Nothing was changed" in many.observation
    )
    assert ctx.sandbox.files["m.py"] == text
    assert EpisodeConfig(tools={"max_read_lines": 40}).tools.max_read_lines == 40  # from YAML
    with pytest.raises(ValueError, match="EpisodeConfig.tools"):
        EpisodeConfig(tools={"max_read_line": 40})
    with pytest.raises(ValueError, match="max_read_lines"):
        ToolConfig(max_read_lines=0)
