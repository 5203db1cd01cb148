"""Oracle repository episodes: a scripted expert that fixes a repo task with its gold patch,
acting through the real harness with the production tools.

For a repository bug-fix task the gold patch is known, so an expert can act as a good agent
would: ``search`` for the function the patch changes, ``read_file`` around it, make the gold
change with ``edit`` (the smallest whole-line edits, each unique in the file when it is made;
one per change block, so a multi-hunk patch takes several), ``run`` the failing tests the
workspace holds, and ``submit``. The expert is a :class:`~coderl.agent.ScriptedPolicy` script:
its messages go through the episode's chat template, call format, parser, tools and sandbox,
and come back as token-exact segments (each message tokenized as the engine would have sampled
it, followed by the stop token), so they train the policy like its own completions.

The path varies with the seed, deterministically (:func:`plan_episode`): some episodes first
look up the failing test and read it (two files), some run the failing tests before the edit as
well as after it, some search twice. At the short levels of the repository ladder
(:mod:`coderl.tasks.ladder`) the path is the level's: L0 (file and line given) reads a window
around the line (tight or the enclosing function), edits, sometimes runs the visible test, and
submits; L1 (the file given) searches that file for the changed function, reads, edits, runs the
test and submits; L2 and L3 take the full path above. When the harness asks for a self-summary (the context
window is full) the expert writes one from what it has done, so summaries are demonstrated too.

Only what the agent can see is used for its actions: held-out tests are blanked in the rollout
workspace, so the expert runs only the visible FAIL_TO_PASS tests (when all are held out: a few
visible PASS_TO_PASS tests of the same files, after the edit). The gold patch decides *what* to
do; the workspace files (the task's rollout base, read on the host) decide the exact text of
the line ranges and edits.

Limits: the expert finds an episode's plan by the task's problem statement in the prompt, so
:func:`oracle_episodes` never runs two episodes whose statements contain one another in the same
batch (one episode per task per seed; tasks with the same statement in separate batches). Comments on test runs follow the observed exit code, but the plan does not change with
what the tools return: an edit that fails (a workspace that differs from the rollout base) is
not repaired. Gold patches that delete files are not supported.
"""

from __future__ import annotations

import ast
import difflib
import hashlib
import random
import re
import shlex
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coderl.agent.episode import Episode, EpisodeConfig
from coderl.agent.parsing import get_call_format
from coderl.agent.runner import run_episodes
from coderl.agent.scripted import ScriptedPolicy
from coderl.grading.pyparse import parse_python
from coderl.tasks.ladder import level_of

TEST_COMMAND = "/venv/bin/python -m pytest -q -p no:cacheprovider --tb=line"
"""How the expert runs tests in a rollout workspace (the environment's virtualenv is at
``/venv``; ``coderl.grading.grade.rollout_sandbox_args``)."""
MAX_TEST_IDS = 3
"""Most test ids one ``run`` names (the rest of a long FAIL_TO_PASS list is left out)."""
READ_CONTEXT = 12
"""Lines shown around a change when the enclosing function is too long to read whole."""
MAX_READ_LINES = 60
"""Longest ``read_file`` range the expert asks for (lines)."""


@dataclass(frozen=True)
class Edit:
    """One ``edit`` call: replace ``old`` (unique in the file when applied) with ``new``.
    ``old=None`` writes a new file with ``write_file``."""

    path: str
    old: str | None
    new: str
    line: int
    """1-based line of the first replaced line (in the file as it is when the edit is made)."""


def _count(text: str, old: str) -> int:
    """Non-overlapping occurrences, as the ``edit`` tool counts them."""
    n, at = 0, text.find(old)
    while at != -1:
        n, at = n + 1, text.find(old, at + len(old))
    return n


def file_edits(path: str, before: str, after: str) -> list[Edit]:
    """The smallest whole-line edits that turn ``before`` into ``after``, in order: one per
    change block of :class:`difflib.SequenceMatcher` on lines, each widened by context lines
    (below first, then above) until its ``old`` text occurs exactly once in the file as it is
    when that edit is applied (edits are applied top to bottom).

    Raises:
        ValueError: no widening makes a block unique (the file repeats itself entirely), or the
            edits do not reproduce ``after`` (a bug here; checked every time).
    """
    a, b = before.splitlines(keepends=True), after.splitlines(keepends=True)
    cur, delta, edits = list(a), 0, []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        start, end = i1 + delta, i2 + delta
        lo, hi, text = start, end, "".join(cur)
        while not (old := "".join(cur[lo:hi])) or _count(text, old) != 1:
            if hi < len(cur) and (hi - end <= start - lo or lo == 0):
                hi += 1
            elif lo > 0:
                lo -= 1
            else:
                raise ValueError(f"{path}: no unique context for the change at line {i1 + 1}")
        new = "".join(cur[lo:start] + b[j1:j2] + cur[end:hi])
        cur[lo:hi] = new.splitlines(keepends=True)
        # the lines as they read, without the last newline, when that keeps ``old`` unique
        if old.endswith("\n") and new.endswith("\n") and _count(text, old[:-1]) == 1:
            old, new = old[:-1], new[:-1]
        edits.append(Edit(path, old, new, lo + 1))
        delta += (j2 - j1) - (i2 - i1)
    if "".join(cur) != after:
        raise ValueError(f"{path}: the edits do not reproduce the gold file")
    return edits


def gold_edits(base: Path, gold_patch: str) -> list[Edit]:
    """The edits that apply ``gold_patch`` to the workspace ``base`` (read on the host), file by
    file in the patch's order; a file the patch creates is one ``write_file``.

    Raises:
        coderl.tasks.patches.PatchError: the patch does not apply to ``base``.
        ValueError: see :func:`file_edits`; a patch that deletes a file.
    """
    from coderl.tasks.patches import apply_patch, split_diff

    edits: list[Edit] = []
    for path, chunk in split_diff(gold_patch):
        src = base / path
        before = src.read_text(encoding="utf-8") if src.is_file() else None
        with tempfile.TemporaryDirectory() as tmp:
            dst = Path(tmp) / path
            dst.parent.mkdir(parents=True, exist_ok=True)
            if before is not None:
                dst.write_text(before, encoding="utf-8")
            apply_patch(Path(tmp), chunk)
            if not dst.is_file():
                raise ValueError(f"{path}: the gold patch deletes it (not supported)")
            after = dst.read_text(encoding="utf-8")
        if before is None:
            edits.append(Edit(path, None, after, 1))
        else:
            edits.extend(file_edits(path, before, after))
    return edits


@dataclass(frozen=True)
class Action:
    """One assistant turn of the expert: a thought and one tool call."""

    thought: str
    tool: str
    arguments: dict[str, Any]
    note: str
    """What this step did, in the summary's words (past tense)."""
    todo: str = ""
    """What this step will do, in the summary's words (imperative)."""
    after_run: bool = False
    """The previous action was a ``run``: open with a remark on its exit code."""


@dataclass
class OraclePlan:
    """The expert's actions for one episode of one task."""

    task_id: str
    statement: str
    actions: list[Action]
    done: int = 0
    """Actions already sent."""
    finding: str = ""
    """Where the bug is and what the fix is, for summaries after the code was read."""
    facts: list[str] = field(default_factory=list)
    """Notes of the actions sent, for summaries."""
    last: str = ""
    """The call text of the last action sent."""


def _enclosing_span(source: str, line: int) -> tuple[int, int] | None:
    """First line (decorators included) and last line of the innermost function around
    ``line``; None when the line is in no function or the file does not parse."""
    try:
        tree = parse_python(source)
    except SyntaxError:
        return None
    best: tuple[int, int] | None = None
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno:
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            if first <= line <= node.end_lineno and (best is None or first >= best[0]):
                best = (first, node.end_lineno)
    return best


def read_range(source: str, first: int, last: int) -> tuple[int, int]:
    """The lines to read to see a change at ``first..last``: the enclosing function when it has
    at most ``MAX_READ_LINES`` lines, else ``READ_CONTEXT`` lines around the change."""
    n = max(1, len(source.splitlines()))
    span = _enclosing_span(source, first)
    if span and span[0] <= last <= span[1] and span[1] - span[0] < MAX_READ_LINES:
        return span
    lo = max(1, first - READ_CONTEXT)
    return lo, min(n, max(last, first) + READ_CONTEXT, lo + MAX_READ_LINES - 1)


def _test_def(source: str, node_id: str) -> int | None:
    """Line of the ``def`` of test ``path::[Class::]name`` in ``source`` (None: not defined)."""
    from coderl.tasks.holdout import defined_tests, function_of

    key = function_of(node_id)
    if key is None:
        return None
    want = key.split("::", 1)[1]
    try:
        tree = parse_python(source)
    except SyntaxError:
        return None
    return next((node.lineno for k, node in defined_tests(tree) if k == want), None)


def _rng(task_id: str, seed: int) -> random.Random:
    return random.Random(hashlib.sha256(f"{task_id}\0{seed}".encode()).digest())


def _pick(rng: random.Random, *options: str) -> str:
    return options[rng.randrange(len(options))]


def _run_command(ids: Sequence[str]) -> str:
    return f"{TEST_COMMAND} " + " ".join(shlex.quote(i) for i in ids[:MAX_TEST_IDS])


def _visible_tests(task: Any) -> tuple[list[str], list[str]]:
    """``(failing, related)``: the FAIL_TO_PASS ids whose test functions are in the workspace,
    and (for when there are none) visible PASS_TO_PASS ids of the same test files."""
    from coderl.tasks.holdout import function_of, visible_fail_to_pass

    held = set(task.held_out_tests)
    failing = visible_fail_to_pass(task)
    files = {i.split("::", 1)[0] for i in task.FAIL_TO_PASS}
    related = [
        i
        for i in task.PASS_TO_PASS
        if i not in held and i.split("::", 1)[0] in files and function_of(i) is not None
    ]
    return failing, related


def _lookup(
    task: Any, base: Path, edits: list[Edit], failing: list[str], rng: random.Random
) -> list[Action]:
    """Actions that find the code: the failing test (sometimes, and sometimes read it too),
    a broad search (sometimes), the definition of the changed function."""
    actions: list[Action] = []
    test_id = failing[0] if failing else ""
    test_file = test_id.split("::", 1)[0]
    test_src = (base / test_file).read_text(encoding="utf-8") if test_id else ""
    test_line = _test_def(test_src, test_id) if test_id else None
    if test_line is not None and rng.random() < 0.35:
        name = test_id.split("[", 1)[0].rsplit("::", 1)[-1]
        thought = _pick(
            rng,
            f"Let me look at the failing test {name} first.",
            f"I will start from the failing test {name}.",
        )
        search = {"pattern": f"def {name}\\(", "path": test_file}
        note = f"found the failing test {name} in {test_file} (line {test_line})"
        actions.append(Action(thought, "search", search, note, "find the failing test"))
        if rng.random() < 0.6:
            end = min(test_line + 24, len(test_src.splitlines()))
            read = {"path": test_file, "start_line": test_line, "end_line": end}
            note = f"read the test in {test_file} lines {test_line}-{end}"
            thought = "I will read the test to see what it expects."
            actions.append(Action(thought, "read_file", read, note, "read the test"))
    function = str(task.extra.get("function") or "").split(".")[-1]
    target = edits[0].path
    if not function or edits[0].old is None:
        return actions
    where = str(Path(target).parent)
    if where != "." and rng.random() < 0.25:  # a broad search first, then a narrow one
        thought = f"The failure points at {function}. I will search for it."
        note = f"searched for {function} in {where}"
        args = {"pattern": function, "path": where}
        actions.append(Action(thought, "search", args, note, f"find {function}"))
    source = (base / target).read_text(encoding="utf-8")
    pattern = re.compile(rf"\s*(async\s+)?def {re.escape(function)}\(")
    lines = source.splitlines()
    def_line = next((n for n, line in enumerate(lines, 1) if pattern.match(line)), None)
    thought = _pick(
        rng,
        f"I need to find where {function} is defined.",
        f"The failing tests exercise {function}; let me find its definition.",
        f"Let me locate the definition of {function}.",
    )
    args = {"pattern": f"def {function}\\(", "path": _pick(rng, where, ".")}
    note = f"found def {function} in {target}" + (f" (line {def_line})" if def_line else "")
    actions.append(Action(thought, "search", args, note, f"find def {function}"))
    return actions


def _fix(edits: list[Edit], command: str, failing: bool, before: bool) -> list[Action]:
    """Actions that run the tests (before the fix when ``before``), edit, run again, submit."""
    actions: list[Action] = []
    if before:
        thought = "Before changing anything I will run the failing tests."
        note = "ran the failing tests before the fix (they fail)"
        actions.append(Action(thought, "run", {"command": command}, note, "run the tests"))
    for i, e in enumerate(edits):
        after_run = bool(actions) and actions[-1].tool == "run"
        if e.old is None:
            thought = f"{e.path} is missing; I will create it."
            args = {"path": e.path, "content": e.new}
            note, todo = f"created {e.path}", f"create {e.path}"
            actions.append(Action(thought, "write_file", args, note, todo, after_run))
            continue
        old, new = e.old.strip("\n"), e.new.strip("\n")
        where = f"{e.path} at line {e.line}"
        if i:
            thought = f"The fix needs one more change in {where}."
        elif "\n" not in old and "\n" not in new:
            thought = f"The bug is in {where}: `{old.strip()}` should be `{new.strip()}`."
        else:
            thought = f"The bug is in {where}. I will fix it."
        args = {"path": e.path, "old": e.old, "new": e.new}
        note, todo = f"edited {where}", f"edit {where}"
        actions.append(Action(thought, "edit", args, note, todo, after_run))
    if command:
        thought = (
            "Now I will run the failing tests again."
            if failing
            else "The failing tests are not in the workspace; I will run other tests of the "
            "same file to check the fix."
        )
        note = "ran the tests after the fix"
        actions.append(Action(thought, "run", {"command": command}, note, "run the tests"))
    after_run = bool(actions) and actions[-1].tool == "run"
    thought = "The fix is done. I will submit."
    actions.append(Action(thought, "submit", {}, "submitted", "submit", after_run))
    return actions


def _short_plan(
    task: Any,
    base: Path,
    edits: list[Edit],
    level: int,
    command: str,
    failing: bool,
    rng: random.Random,
) -> OraclePlan:
    """The expert's actions at ladder level 0 or 1 (:mod:`coderl.tasks.ladder`). L0 (the
    statement names the file and line): read a window around the line, edit, (sometimes run the
    visible test,) submit. L1 (the file only): search the file for the changed function's
    definition (or read its top when the function is unknown), read, edit, (run,) submit."""
    e = edits[0]
    assert e.old is not None  # a ladder level below 2 is offered only for a one-edit fix
    text = (base / e.path).read_text(encoding="utf-8")
    last_changed = e.line + e.old.count("\n")
    actions: list[Action] = []
    if level == 1:
        function = str(task.extra.get("function") or "").split(".")[-1]
        if function:
            thought = _pick(
                rng,
                f"The bug is in {e.path}. Let me find {function} there.",
                f"I will search {e.path} for the definition of {function}.",
            )
            args = {"pattern": f"def {function}\\(", "path": e.path}
            note = f"found def {function} in {e.path}"
            actions.append(Action(thought, "search", args, note, f"find def {function}"))
    if level == 0 and rng.random() < 0.5:  # a tight window around the named line
        n = len(text.splitlines())
        first, last = max(1, e.line - 4), min(n, last_changed + 4)
    else:
        first, last = read_range(text, e.line, last_changed)
    thought = _pick(
        rng,
        f"Let me read {e.path} around line {e.line}.",
        f"I will look at the code in {e.path} first.",
    )
    args = {"path": e.path, "start_line": first, "end_line": last}
    note, todo = f"read {e.path} lines {first}-{last}", f"read {e.path}"
    actions.append(Action(thought, "read_file", args, note, todo))
    run_after = bool(command) and (level == 1 or rng.random() < 0.3)
    actions += _fix(edits, command if run_after else "", failing, False)
    finding = f"{e.path} line {e.line}: {e.old.strip()!r} must become {e.new.strip()!r}."
    return OraclePlan(task.id, task.problem_statement, actions, finding=finding)


def plan_episode(task: Any, base: Path, seed: int = 0) -> OraclePlan:
    """The expert's actions for ``task`` whose rollout workspace is ``base`` (on the host):
    find the code, read it, (run the tests,) edit, run the tests, submit; at ladder levels 0
    and 1 (``task.extra["ladder"]``) the shorter paths of :func:`_short_plan`. The optional
    steps and the wording are drawn from ``(task.id, seed)``.

    Raises:
        coderl.tasks.patches.PatchError, ValueError: from :func:`gold_edits`.
    """
    rng = _rng(task.id, seed)
    edits = gold_edits(base, task.gold_patch)
    failing, related = _visible_tests(task)
    level = level_of(task)
    if level is not None and level < 2 and len(edits) == 1 and edits[0].old is not None:
        command = _run_command(failing or related) if failing or related else ""
        return _short_plan(task, base, edits, level, command, bool(failing), rng)
    actions = _lookup(task, base, edits, failing, rng)
    finding = ""
    first_edits = {}  # the first edit of each file, in the patch's order
    for e in edits:
        if e.old is not None:
            first_edits.setdefault(e.path, e)
    for e in first_edits.values():
        assert e.old is not None
        text = (base / e.path).read_text(encoding="utf-8")
        first, last = read_range(text, e.line, e.line + e.old.count("\n"))
        thought = _pick(
            rng, f"Let me read {e.path} around line {e.line}.", f"I will read the code in {e.path}."
        )
        args = {"path": e.path, "start_line": first, "end_line": last}
        note, todo = f"read {e.path} lines {first}-{last}", f"read {e.path}"
        actions.append(Action(thought, "read_file", args, note, todo))
    for e in edits[:3]:
        if e.old is not None:
            finding += f" {e.path} line {e.line}: {e.old.strip()!r} must become {e.new.strip()!r}."
    command = _run_command(failing or related) if failing or related else ""
    before = bool(failing) and rng.random() < 0.4
    actions += _fix(edits, command, bool(failing), before)
    return OraclePlan(task.id, task.problem_statement, actions, finding=finding.strip())


_EXIT = re.compile(r"exit code (-?\d+)")


class OracleExpert:
    """The expert as a :class:`~coderl.agent.ScriptedPolicy` script: from the decoded prompt,
    the next message of the plan whose problem statement the prompt holds, or a summary when
    the prompt ends with the summary instruction.

    Raises (from ``__call__``):
        KeyError: no plan's statement is in the prompt.
        IndexError: the plan is finished (the harness asked for another turn after ``submit``).
    """

    def __init__(self, plans: Sequence[OraclePlan], call_format: str, summary_instruction: str):
        self.plans = list(plans)
        self.format = get_call_format(call_format)
        self.summary_instruction = summary_instruction

    def _plan(self, prompt: str) -> OraclePlan:
        for plan in self.plans:
            if plan.statement in prompt:
                return plan
        raise KeyError("no oracle plan for this prompt")

    def __call__(self, prompt: str) -> str:
        plan = self._plan(prompt)
        tail = prompt[-(len(self.summary_instruction) + 200) :]
        if self.summary_instruction in tail:
            return self.summary(plan)
        if plan.done >= len(plan.actions):
            raise IndexError(f"{plan.task_id}: the oracle plan has no action left")
        action = plan.actions[plan.done]
        thought = action.thought
        at = prompt.rfind(plan.last) if plan.last else -1
        if action.after_run and at >= 0:  # the run's output is in this window: remark on it
            codes = _EXIT.findall(prompt[at:])
            ok = bool(codes) and codes[-1] == "0"
            remark = "The tests pass." if ok else "The tests fail, as the task says."
            if not ok and action.tool == "submit":
                remark = "Some of these tests still fail."
            thought = f"{remark} {thought}"
        plan.done += 1
        plan.facts.append(action.note)
        plan.last = self.format.format_call(action.tool, action.arguments)
        return f"{thought}\n{plan.last}"

    def summary(self, plan: OraclePlan) -> str:
        """What the expert has done, what it found (once it has read the code to change) and
        what is left, for the next context window."""
        lines = ["Progress so far:", *(f"- I {fact}." for fact in plan.facts)]
        if len(lines) == 1:
            lines.append("- Nothing yet.")
        if plan.finding and any(f.startswith("read ") for f in plan.facts):
            lines.append(f"Found: {plan.finding}")
        todo = list(dict.fromkeys(a.todo for a in plan.actions[plan.done :]))
        lines.append("Next: " + ("; ".join(todo) if todo else "nothing") + ".")
        return "\n".join(lines)


def oracle_episodes(
    tokenizer: Any,
    tasks: Sequence[Any],
    cfg: EpisodeConfig,
    *,
    seeds: Sequence[int] = (0,),
    max_workers: int = 8,
) -> list[Episode]:
    """Oracle episodes of repo ``tasks`` through the harness with ``cfg``: for each seed, one
    episode per task (tasks of a round run concurrently), each in a fresh rollout sandbox.
    Episodes are returned seed by seed, in task order. Tasks whose statements contain one
    another run in separate batches.

    Raises:
        KeyError: a task's environment is not built (``coderl tasks build-env``).
        coderl.tasks.patches.PatchError, ValueError: a gold patch the expert cannot replay.
    """
    from coderl.grading.grade import rollout_base, rollout_sandbox

    bases = {t.id: rollout_base(t) for t in tasks}
    episodes: list[Episode] = []
    for seed in seeds:
        by_id: dict[int, Episode] = {}
        for batch in _apart(list(tasks)):
            plans = [plan_episode(t, bases[t.id], seed) for t in batch]
            expert = OracleExpert(plans, cfg.call_format, cfg.summary_instruction)
            jobs = [(t, rollout_sandbox(t)) for t in batch]
            try:
                ran = run_episodes(
                    ScriptedPolicy(tokenizer, expert), jobs, cfg, max_workers=max_workers
                )
            finally:
                for _, sb in jobs:
                    sb.close()
            by_id |= {id(t): ep for t, ep in zip(batch, ran, strict=True)}
        episodes += [by_id[id(t)] for t in tasks]  # task order, whatever the batches were
    return episodes


def _apart(tasks: list[Any]) -> list[list[Any]]:
    """``tasks`` in batches in which no problem statement contains another's (the expert finds
    an episode's plan by its statement), each batch in task order; one batch when all differ."""
    batches: list[list[Any]] = []
    for t in tasks:
        s = t.problem_statement
        for b in batches:
            if not any(s in u.problem_statement or u.problem_statement in s for u in b):
                b.append(t)
                break
        else:
            batches.append([t])
    return batches
