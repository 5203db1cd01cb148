"""Scripted agents for the online gate's held-out suite (the run's HumanEval environment): each
writes a task's gold solution (optionally with extra code first) and submits."""

from __future__ import annotations

from typing import Any

from coderl.agent.parsing import CALL_FORMATS
from coderl.agent.scripted import ScriptedPolicy
from coderl.policy.tiny import tiny_tokenizer


def gold_code(task: Any) -> str:
    """The post-image of ``solution.py`` under the task's gold patch."""
    patch = task.gold_patch.splitlines()
    added = [x[1:] for x in patch if x.startswith("+") and x[:3] != "+++"]
    return task.workspace_files["solution.py"] + "".join(x + "\n" for x in added)


def solver(cfg: Any, tasks: list[Any], prefix: str = "") -> ScriptedPolicy:
    """Writes ``prefix`` + the gold solution of the task its prompt names, then submits (in the
    run's call format)."""
    fmt = CALL_FORMATS[cfg.tasks.options["episode"]["call_format"]]

    def script(prompt: str) -> str:
        if prompt.count("assistant") > 1:  # a turn already acted: submit
            return fmt.format_call("submit", {})
        task = next(t for t in tasks if f"Implement `{t.extra['entry_point']}`" in prompt)
        return fmt.format_call(
            "write_file", {"path": "solution.py", "content": prefix + gold_code(task)}
        )

    return ScriptedPolicy(tiny_tokenizer(), script)
