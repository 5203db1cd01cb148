"""Oracle repository episodes (coderl.agent.oracle): gold edits, varied paths, and replays that
resolve their task in a fresh grading sandbox, for every mutation kind of every shipped library.

The replay test takes one task per mutation kind of the shipped data, each from the cheapest
library that has it; ``CODERL_ORACLE_WALK=all`` makes it walk every shipped task (the full walk: add ``-o timeout=0``, a library takes longer than the
suite's 300 s per-test limit; its last result is in docs/training.md).
"""

from __future__ import annotations

import gzip
import json
import os
import shlex
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from coderl.agent.episode import EpisodeConfig
from coderl.agent.oracle import (
    OracleExpert,
    OraclePlan,
    _count,
    file_edits,
    oracle_episodes,
    plan_episode,
)
from coderl.config import load_config

ROOT = Path(__file__).parent.parent
TASK_FILES = sorted((ROOT / "data" / "tasks").glob("*.jsonl.gz"))
REPO_BUGFIX = ROOT / "configs" / "repo-bugfix.yaml"
DEMO_REPO = ROOT / "configs" / "demo-repo.yaml"

needs_sandbox = pytest.mark.skipif(
    shutil.which("bwrap") is None or os.geteuid() != 0,
    reason="needs bubblewrap and root (make sysdeps); CI has both",
)


def _apply(text: str, edits) -> str:
    """Apply edits as the ``edit`` tool does, checking each ``old`` is unique when applied."""
    for e in edits:
        assert _count(text, e.old) == 1, e
        text = text.replace(e.old, e.new, 1)
    return text


def test_gold_edits_are_the_changed_lines_widened_only_until_unique():
    before = "def f(x):\n    return x\n\ndef g(x):\n    return x\n"
    after = "def f(x):\n    return x\n\ndef g(x):\n    return x + 1\n"
    (e,) = file_edits("m.py", before, after)
    # "    return x" occurs twice: one line of context above makes it unique; the final newline
    # is dropped because the text stays unique without it
    assert (e.old, e.new, e.line) == ("def g(x):\n    return x", "def g(x):\n    return x + 1", 4)
    assert _apply(before, [e]) == after


def test_gold_edits_delete_insert_and_several_blocks():
    before = "a = 1\nb = 2\nc = 3\nd = 4\ne = 5\nf = 6\n"
    after = "a = 1\nc = 3\nd = 4\nX = 0\ne = 5\nf = 7\n"
    edits = file_edits("m.py", before, after)
    # three change blocks -> three edits, top to bottom: delete "b = 2", insert after "d = 4",
    # replace "f = 6"; a deletion keeps its newline in old (new is empty), an insertion takes
    # the line below it as context
    assert [(e.old, e.new) for e in edits] == [
        ("b = 2\n", ""),
        ("e = 5", "X = 0\ne = 5"),
        ("f = 6", "f = 7"),
    ]
    assert _apply(before, edits) == after


def test_an_edit_is_unique_in_the_file_as_it_is_when_applied():
    # after the first edit the text "y = 1" exists twice: the second edit needs context
    before = "x = 0\nz = 1\ny = 1\n"
    after = "y = 1\nz = 1\ny = 2\n"
    edits = file_edits("m.py", before, after)
    assert _apply(before, edits) == after


# libraries whose environments build and whose suites run fastest come first: the CI sample
# takes each mutation kind from the first library that has it (python-dateutil's build alone
# takes many minutes; its one task is in the full walk)
CHEAP_FIRST = ["toolz", "six", "idna", "boltons", "inflection", "toml", "parse", "python-slugify"]


def _tasks_by_kind(walk_all: bool) -> dict[str, list]:
    """Library -> the tasks the replay test walks: every task (``walk_all``), else one task per
    mutation kind over all shipped libraries, each kind from the cheapest library that has it."""
    from coderl.tasks.spec import load_tasks

    names = {p.name.removesuffix(".jsonl.gz"): p for p in TASK_FILES}
    order = [n for n in CHEAP_FIRST if n in names] + sorted(set(names) - set(CHEAP_FIRST))
    out, seen = {}, set()
    for name in order:
        picked = []
        for t in load_tasks(names[name]):
            if walk_all or t.difficulty.mutation not in seen:
                seen.add(t.difficulty.mutation)
                picked.append(t)
        if picked:
            out[name] = picked
    return out


WALK_ALL = os.environ.get("CODERL_ORACLE_WALK") == "all"
BY_LIBRARY = _tasks_by_kind(WALK_ALL)


def _episode_config(budget: int | None = None) -> EpisodeConfig:
    cfg = load_config(REPO_BUGFIX)
    ep = cfg.tasks.options["episode"]
    return EpisodeConfig(
        max_turns=cfg.rollout.max_turns,
        max_tokens=cfg.rollout.max_turns * cfg.rollout.max_new_tokens,
        max_tokens_per_turn=cfg.rollout.max_new_tokens,
        context_budget=budget or cfg.rollout.max_context_tokens,
        call_format=ep["call_format"],
        instructions=ep["instructions"],
    )


def test_the_shipped_data_has_the_mutation_kinds_the_walk_covers():
    kinds = {t.difficulty.mutation for ts in BY_LIBRARY.values() for t in ts}
    assert len(TASK_FILES) >= 5 and len(kinds) >= 10, kinds
    assert all(t.kind == "repo" for ts in BY_LIBRARY.values() for t in ts)


@needs_sandbox
@pytest.mark.parametrize("library", sorted(BY_LIBRARY))
def test_oracle_replay_resolves_every_mutation_kind(library, smollm2_tokenizer):
    """Each oracle episode, run through the harness (template, call format, parser, tools,
    sandbox), submits a diff that resolves its task in a fresh grading sandbox, with every
    call run cleanly and held-out tests never named."""
    from coderl.envbuild.build import build_env
    from coderl.grading.grade import grade
    from coderl.train.sft import clean_oracle_episode

    tasks = BY_LIBRARY[library]
    build_env(tasks[0].source.removeprefix("pypi:"))
    episodes = oracle_episodes(smollm2_tokenizer, tasks, _episode_config(), max_workers=4)
    with ThreadPoolExecutor(4) as pool:
        grades = list(pool.map(lambda p: grade(p[0], p[1].diff), zip(tasks, episodes, strict=True)))
    failed = [
        (t.id, t.difficulty.mutation, ep.stats.finish_reason, g.grading_error)
        for t, ep, g in zip(tasks, episodes, grades, strict=True)
        if not (g.resolved and clean_oracle_episode(ep))
    ]
    assert not failed, failed
    for t, ep in zip(tasks, episodes, strict=True):
        named = {
            word
            for r in ep.tool_calls
            if r.name == "run" and r.arguments
            for word in shlex.split(r.arguments["command"])
        }
        assert not named & set(t.held_out_tests)  # only visible tests are run
        assert {r.name for r in ep.tool_calls} >= {"search", "read_file", "edit", "submit"}


@needs_sandbox
def test_an_oracle_episode_that_must_summarise_still_resolves(smollm2_tokenizer):
    """A window of 1,536 tokens cannot hold the statement, the code read and the fix: the expert
    summarises (its summary names the bug), goes on in the new window and resolves the task."""
    from coderl.envbuild.build import build_env
    from coderl.grading.grade import grade

    task = min(BY_LIBRARY["toolz"], key=lambda t: len(t.problem_statement))
    build_env(task.source.removeprefix("pypi:"))
    (ep,) = oracle_episodes(smollm2_tokenizer, [task], _episode_config(budget=1536))
    assert ep.stats.summaries >= 1 and len(ep.trajectory.segments) == ep.stats.summaries + 1
    summary = ep.transcripts[1][1]["content"]  # the new window's task message
    assert "Summary of your progress so far:" in summary and "must become" in summary
    assert ep.stats.finish_reason == "submitted" and grade(task, ep.diff).resolved


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    """The default model's tokenizer (from its GGUF, a few seconds): the budgets of the preset
    are in its tokens."""
    from transformers import AutoTokenizer

    from coderl.policy.loading import smollm2_gguf_path

    path = smollm2_gguf_path()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)


def _first_task():
    from coderl.tasks.spec import parse_task_line

    with gzip.open(TASK_FILES[0], "rt") as f:
        return parse_task_line(f.readline())


@needs_sandbox
def test_paths_vary_with_the_seed_and_repeat_for_the_same_seed():
    from coderl.envbuild.build import build_env
    from coderl.grading.grade import rollout_base

    shapes = {}
    for path in TASK_FILES[:2]:
        with gzip.open(path, "rt") as f:
            rows = [json.loads(line) for line in f][:10]
        from coderl.tasks.spec import Task

        tasks = [Task.model_validate(r) for r in rows]
        build_env(tasks[0].source.removeprefix("pypi:"))
        for t in tasks:
            base = rollout_base(t)
            for seed in range(4):
                plan = plan_episode(t, base, seed)
                again = plan_episode(t, base, seed)
                assert plan.actions == again.actions  # deterministic per (task, seed)
                shapes[(t.id, seed)] = tuple(a.tool for a in plan.actions)
    kinds = set(shapes.values())
    assert len(kinds) >= 4, kinds
    assert any(s.count("read_file") == 2 for s in kinds)  # the test and the code
    assert any(s.index("run") < s.index("edit") for s in kinds if "run" in s)  # run before
    assert any(s[:2] == ("search", "search") for s in kinds)  # two searches


def test_summary_reports_what_was_done_and_what_is_left():
    from coderl.agent.oracle import Action

    plan = OraclePlan(
        "t",
        "STATEMENT",
        [
            Action(
                "Find it.", "search", {"pattern": "def f\\(", "path": "."}, "found def f", "find f"
            ),
            Action("Read it.", "read_file", {"path": "m.py"}, "read m.py lines 1-5", "read m.py"),
            Action(
                "Fix.", "edit", {"path": "m.py", "old": "a", "new": "b"}, "edited m.py", "edit m.py"
            ),
            Action("Done.", "submit", {}, "submitted", "submit"),
        ],
        finding="m.py line 3: 'a' must become 'b'.",
    )
    expert = OracleExpert([plan], "xml", "SUMMARISE NOW")
    first = expert("...STATEMENT...")
    assert first.startswith("Find it.\n<tool_call>") and "<function=search>" in first
    expert("...STATEMENT...")
    summary = expert("...STATEMENT... SUMMARISE NOW")
    assert "I found def f" in summary and "I read m.py" in summary
    assert "'a' must become 'b'" in summary and "Next: edit m.py; submit." in summary
    assert "<function=edit>" in expert("STATEMENT + summary")  # the plan goes on after it


def test_shipped_repo_presets_run_on_the_shipped_files_and_split_by_repository():
    from coderl.envs import build_environment
    from coderl.tasks.repos import read_repos
    from coderl.tasks.repos import repo_of as repository

    for preset in (REPO_BUGFIX, DEMO_REPO):
        cfg = load_config(preset)
        env = build_environment(cfg)
        train, heldout = env.tasks(cfg.tasks.train_split), env.tasks(cfg.tasks.heldout_split)
        held = {r.name for r in read_repos() if r.split == "heldout"}
        assert train and heldout
        assert {repository(t) for t in heldout} == held
        assert not {repository(t) for t in train} & held  # never trained on
        # round-robin: the evaluated prefix covers every held-out repository
        assert {repository(t) for t in heldout[: cfg.eval.tasks]} == held
        assert cfg.sft.enabled and cfg.rollout.max_context_tokens <= 4096


def test_oracle_episodes_come_back_in_task_order_when_statements_force_two_batches(monkeypatch):
    """Tasks whose statements contain one another run in separate batches; the episodes still
    come back in task order (they were once returned batch by batch, which paired a task with
    another task's episode and graded the wrong diff)."""
    from types import SimpleNamespace

    import coderl.agent.oracle as oracle
    import coderl.grading.grade as grading

    tasks = [
        SimpleNamespace(id="a", problem_statement="fix x"),
        SimpleNamespace(id="b", problem_statement="fix x and y"),  # contains a's: apart
        SimpleNamespace(id="c", problem_statement="other"),
    ]
    closed = []
    monkeypatch.setattr(grading, "rollout_base", lambda t: Path("/nonexistent"))
    monkeypatch.setattr(
        grading, "rollout_sandbox", lambda t: SimpleNamespace(close=lambda: closed.append(t.id))
    )
    monkeypatch.setattr(oracle, "plan_episode", lambda t, base, seed: SimpleNamespace(t=t))
    monkeypatch.setattr(oracle, "OracleExpert", lambda plans, *a: plans)
    monkeypatch.setattr(oracle, "ScriptedPolicy", lambda tok, expert: expert)
    batches = []

    def run(policy, jobs, cfg, max_workers):
        batches.append([t.id for t, _ in jobs])
        return [f"episode of {t.id}" for t, _ in jobs]

    monkeypatch.setattr(oracle, "run_episodes", run)
    eps = oracle.oracle_episodes(None, tasks, _episode_config(), seeds=(0, 1))
    assert len(batches) == 4 and all(len(b) < 3 for b in batches)  # two batches per seed
    assert eps == [f"episode of {t}" for t in "abc"] * 2
    assert sorted(closed) == sorted("abcabc")
