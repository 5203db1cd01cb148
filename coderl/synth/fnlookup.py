"""Can a lookup pass a function task? The statement must not let one (issue 47, class 3).

A function-repair statement may show the failing assertion (``assert candidate(x) == y``), and a
file's docstrings may hold examples (``>>> f(x)``). A policy that keeps the bug and answers the
inputs it was shown from a table passes the whole check whenever every call the bug gets wrong
is one of those: the reward then pays for a lookup, not a repair. :func:`lookup_passes` plays
that policy against each task's hidden check: the candidate answers every *shown* input
(:func:`shown_inputs`: a call of ``candidate`` or of the entry point, with literal arguments,
anywhere in the statement or the workspace) as the gold solution does and every other one as
the buggy file does. A task it passes leaks; such a statement is restated without the assertion
(:func:`coderl.synth.fnrepair.hidden_statement`) or the task is dropped.

The play runs in one sandbox for a whole batch (each task under a ``signal.alarm``): the check,
buggy file and gold file of shipped and synthesised tasks, no agent code. It calls the check
in-process (values are not copied as the grader's out-of-process judge copies them), so a check
that depends on object identity may be judged differently (none is known to).
"""

from __future__ import annotations

import ast
import json
import re
import tempfile
from pathlib import Path
from typing import Any

from coderl.tasks.spec import Task

LOOKUP_TIMEOUT_S = 2
"""Seconds the play of one task may take (a check that loops on the buggy answers fails)."""

_PLAY = r"""
import copy, json, signal, sys

def alarm(*_):
    raise TimeoutError()

signal.signal(signal.SIGALRM, alarm)
out = {}
for t in json.load(open(sys.argv[1])):
    shown = [eval(s, {}) for s in t['shown']]  # literals written by the host
    gold, bug, glob = {}, {}, {}
    signal.alarm(TIMEOUT)
    try:
        exec(compile(t['gold'], 'gold.py', 'exec'), gold)
        exec(compile(t['buggy'], 'solution.py', 'exec'), bug)
        exec(compile(t['buggy'], 'solution.py', 'exec'), glob)
        g, b = gold[t['entry']], bug[t['entry']]

        def candidate(*args, **kwargs):
            if any(args == a and kwargs == k for a, k in shown):
                return g(*copy.deepcopy(args), **copy.deepcopy(kwargs))
            return b(*args, **kwargs)

        glob[t['entry']] = candidate
        exec(compile(t['check'], 'hidden_test.py', 'exec'), glob)
        glob['check'](candidate)
        out[t['id']] = True
    except BaseException:
        out[t['id']] = False
    finally:
        signal.alarm(0)
print('RESULT ' + json.dumps(out))
"""


def _literal_call(src: str, start: int) -> str | None:
    """The source of the call whose ``(`` is at ``start``, up to its balancing ``)``."""
    depth = 0
    for i in range(start, min(len(src), start + 20_000)):
        depth += {"(": 1, ")": -1}.get(src[i], 0)
        if depth == 0:
            return src[start : i + 1]
    return None


def shown_inputs(task: Task) -> list[str]:
    """Each input a task shows its reader, as the source of a ``(args, kwargs)`` literal: every
    call of ``candidate`` or of the entry point whose arguments are literals, in the statement
    and the workspace files (the shown assertion, docstring examples)."""
    entry = str(task.extra.get("entry_point", ""))
    texts = [task.problem_statement, *task.workspace_files.values()]
    names = "|".join(re.escape(n) for n in ("candidate", entry) if n)
    found: list[str] = []
    for text in texts:
        for m in re.finditer(rf"(?<![\w.])(?:{names})\s*(?=\()", text):
            call = _literal_call(text, m.end())
            try:
                node = ast.parse(f"f{call}", mode="eval").body if call else None
            except SyntaxError:
                continue
            if not isinstance(node, ast.Call):
                continue
            try:
                args = tuple(ast.literal_eval(a) for a in node.args)
                kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg}
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                continue
            text_of = repr((args, kwargs))
            if text_of not in found:
                found.append(text_of)
    return found


def lookup_passes(tasks: list[Task]) -> dict[str, bool]:
    """Task id -> whether the lookup policy (module docstring) passes the task's hidden check;
    function tasks with a ``gold_file`` only (others are left out). One sandbox for the batch.

    Raises:
        RuntimeError: the sandbox printed no result (infrastructure).
    """
    from coderl.sandbox import Sandbox

    batch = [
        {
            "id": t.id,
            "entry": t.extra["entry_point"],
            "gold": t.extra["gold_file"],
            "buggy": t.workspace_files["solution.py"],
            "check": next(iter(t.hidden_tests.values())),
            "shown": shown_inputs(t),
        }
        for t in tasks
        if t.kind == "function" and "gold_file" in t.extra and len(t.hidden_tests) == 1
    ]
    if not batch:
        return {}
    with tempfile.TemporaryDirectory(prefix="coderl-lookup-") as tmp:
        Path(tmp, "tasks.json").write_text(json.dumps(batch))
        Path(tmp, "play.py").write_text(_PLAY.replace("TIMEOUT", str(LOOKUP_TIMEOUT_S)))
        with Sandbox.create(tmp) as sb:
            res = sb.exec(
                "cd /testbed && python3 -I play.py tasks.json",
                timeout=LOOKUP_TIMEOUT_S * len(batch) + 60,
            )
    marks = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")]
    if not marks:
        raise RuntimeError(f"the lookup play printed nothing: {res.stderr[-300:]}")
    result: dict[str, Any] = json.loads(marks[-1].removeprefix("RESULT "))
    return {k: bool(v) for k, v in result.items()}
