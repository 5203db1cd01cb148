"""SWE-bench-format task instances in and out of coderl's task spec.

The instance format is the one SWE-bench ships (Jimenez et al., 2024, section 2.1 and the
``princeton-nlp/SWE-bench`` dataset card) and SWE-Gym / SWE-smith reuse: ``instance_id``,
``repo``, ``base_commit``, ``patch`` (the gold fix), ``test_patch`` (the tests that define the
fix), ``FAIL_TO_PASS`` / ``PASS_TO_PASS`` (JSON-encoded lists of test ids, or plain lists),
``problem_statement``, ``version``, ``environment_setup_commit``, ``created_at``, ``hints_text``.
Files are JSONL (``.gz`` allowed) or one JSON array of objects.

Mapping, instance -> :class:`~coderl.tasks.spec.Task`:

- ``instance_id`` -> ``id``; ``patch`` -> ``gold_patch``; FAIL_TO_PASS, PASS_TO_PASS and
  ``problem_statement`` keep their names;
- the environment: the coderl extension's ``env_id``, else the one given to the reader (``env``),
  else the built environment whose snapshot digest is the instance's ``snapshot`` or
  ``base_commit``. coderl grades against the environment's own test files, so a non-empty
  ``test_patch`` must already be in that snapshot (checked with ``git apply --reverse --check``):
  build the environment from ``base_commit`` with the ``test_patch`` applied;
- the SWE-bench fields coderl has no slot for are kept in ``extra["swebench"]``.

Export writes every task as an instance plus a ``coderl`` object with the fields SWE-bench has no
slot for (``env_id``, ``bug_patch``, ``hidden_tests``, ``difficulty``, ``split``, ...), so that
import -> export -> import is the identity. A coderl task's starting state is the environment's
snapshot with ``bug_patch`` applied; ``base_commit`` is then ``snapshot:<digest>``, not a git
commit, and a consumer that ignores ``coderl.bug_patch`` starts from the fixed code.

Instances that bring their own image (:func:`read_image_tasks`): the repository lives at the
image's ``/testbed`` and the instance's own eval script grades it (swebench 5.x's ``image``,
``eval_script``, ``log_parser``; SWE-smith's ``image_name``, R2E-Gym's ``docker_image``, or the
SWE-bench naming scheme, :func:`instance_image`). Such a task's ``env_id`` is ``image:<image>``
(:data:`IMAGE_PREFIX`): no coderl environment is built for it; its episodes and grades run in
containers of that image (``coderl.grading.harness``, the ``swebench`` task source).

Not supported: SWE-smith's convention that ``patch`` is the bug-introducing diff (read such files
with the bug in ``coderl.bug_patch``).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from coderl.tasks.env import EnvRecord, find_env
from coderl.tasks.patches import paths_in_diff
from coderl.tasks.spec import Task, TaskFileError, _open

SWEBENCH_KEYS = (
    "repo",
    "base_commit",
    "test_patch",
    "version",
    "environment_setup_commit",
    "created_at",
    "hints_text",
)
"""Instance fields kept in ``Task.extra["swebench"]`` (with any field coderl does not know)."""
SWEBENCH_NAMESPACE = "swebench"
"""Docker Hub namespace of SWE-bench's published instance images."""
IMAGE_KEYS = ("image", "image_name", "docker_image")
"""Instance fields that name an image: swebench 5.x datasets, SWE-smith, R2E-Gym/SWE-Gym."""
IMAGE_PREFIX = "image:"
"""``Task.env_id`` prefix of a task whose environment is its instance's own image."""


class Instance(BaseModel):
    """The fields coderl reads from an instance; others are kept as they are."""

    model_config = ConfigDict(extra="allow")

    instance_id: str = Field(min_length=1)
    repo: str = Field(min_length=1)
    patch: str = Field(min_length=1)
    problem_statement: str = Field(min_length=1)
    FAIL_TO_PASS: list[str] = Field(min_length=1)
    PASS_TO_PASS: list[str] = Field(default_factory=list)
    base_commit: str = ""
    snapshot: str = ""
    test_patch: str = ""
    coderl: dict[str, Any] | None = None

    @field_validator("FAIL_TO_PASS", "PASS_TO_PASS", mode="before")
    @classmethod
    def _json_list(cls, value: Any) -> Any:
        """SWE-bench ships the test lists as JSON-encoded strings: decode them."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"not a JSON-encoded list: {e.msg}") from None
        return value


def instance_image(
    instance: dict[str, Any],
    *,
    namespace: str = SWEBENCH_NAMESPACE,
    arch: str = "x86_64",
    tag: str = "latest",
) -> str:
    """The image of a SWE-bench-format instance: the first of ``IMAGE_KEYS`` it has, else the
    SWE-bench scheme ``{namespace}/sweb.eval.{arch}.{instance_id lowercased}:{tag}`` with ``__``
    written ``_1776_`` (Docker Hub names cannot hold ``__``). Raises KeyError (no instance_id)."""
    for key in IMAGE_KEYS:
        if instance.get(key):
            return str(instance[key])
    key = f"sweb.eval.{arch}.{instance['instance_id'].lower()}:{tag}"
    return f"{namespace}/{key}".replace("__", "_1776_")


def read_instances(path: str | Path) -> list[tuple[int, dict[str, Any]]]:
    """``(line, object)`` for every instance in a JSONL(.gz) file or a JSON array file.

    Raises:
        TaskFileError: invalid JSON (field ``<json>``) or an item that is not an object.
    """
    with _open(path, "rt") as f:
        text = f.read()
    stripped = text.lstrip()
    out: list[tuple[int, dict[str, Any]]] = []
    if stripped.startswith("["):
        decoder = json.JSONDecoder()
        pos = len(text) - len(stripped) + 1
        while True:
            while pos < len(text) and text[pos] in " \t\r\n,":
                pos += 1
            if pos >= len(text) or text[pos] == "]":
                break
            line = text.count("\n", 0, pos) + 1
            try:
                item, pos = decoder.raw_decode(text, pos)
            except json.JSONDecodeError as e:
                msg = f"invalid JSON: {e.msg} (column {e.colno})"
                raise TaskFileError(path, e.lineno, "<json>", msg) from None
            out.append((line, item))
    else:
        for number, line_text in enumerate(text.splitlines(), start=1):
            if not line_text.strip():
                continue
            try:
                out.append((number, json.loads(line_text)))
            except json.JSONDecodeError as e:
                msg = f"invalid JSON: {e.msg} (column {e.colno})"
                raise TaskFileError(path, number, "<json>", msg) from None
    for line, item in out:
        if not isinstance(item, dict):
            raise TaskFileError(path, line, "<object>", f"expected an object, got {type(item)}")
    return out


def _envs(cache: Path | None) -> list[EnvRecord]:
    from coderl.tasks.snapshot import cache_dir

    root = cache or cache_dir()
    return [EnvRecord.load(p) for p in sorted((root / "envs").glob("*/env.json"))]


def _resolve_env(inst: Instance, env: EnvRecord | None, cache: Path | None) -> EnvRecord | None:
    if env is not None:
        return env
    refs = {r.removeprefix("snapshot:") for r in (inst.snapshot, inst.base_commit) if r}
    for rec in _envs(cache):
        if rec.snapshot_digest in refs or rec.env_id in refs:
            return rec
    return None


def _instance(raw: dict[str, Any], path: str | Path, line: int) -> Instance:
    """``raw`` validated as an :class:`Instance`. Raises TaskFileError (the first bad field)."""
    try:
        return Instance.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "<object>"
        raise TaskFileError(path, line, field, first["msg"]) from None


def _read_tasks(path: str | Path, convert: Callable[[dict[str, Any], int], Task]) -> list[Task]:
    """``convert(instance, line)`` of every instance of ``path``. Raises TaskFileError (from
    ``convert``, or a duplicate id)."""
    tasks: list[Task] = []
    seen: dict[str, int] = {}
    for line, raw in read_instances(path):
        task = convert(raw, line)
        if task.id in seen:
            msg = f"duplicate instance_id {task.id!r} (first on line {seen[task.id]})"
            raise TaskFileError(path, line, "instance_id", msg)
        seen[task.id] = line
        tasks.append(task)
    return tasks


def _copy_touched(snapshot: Path, diffs: list[str], dest: Path) -> None:
    """Copy into ``dest`` the files of ``snapshot`` that any of ``diffs`` touches."""
    for rel in {p for d in diffs for p in paths_in_diff(d)}:
        src = snapshot / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            (dest / rel).write_bytes(src.read_bytes())


def _git_apply(where: Path, diff: str, *flags: str) -> str:
    """``git apply FLAGS`` of ``diff`` in ``where`` (not a repository): ``""`` when it applied,
    else git's complaint (its last 500 characters)."""
    (where / ".coderl.diff").write_text(diff)
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(where.parent))
    proc = subprocess.run(
        ["git", "apply", *flags, ".coderl.diff"], cwd=where, capture_output=True, text=True, env=env
    )
    (where / ".coderl.diff").unlink()
    return "" if proc.returncode == 0 else (proc.stderr.strip() or "does not apply")[-500:]


def check_test_patch(test_patch: str, snapshot: Path) -> str:
    """``""`` when ``snapshot`` already holds ``test_patch``'s result, else git's complaint.

    Checked with ``git apply --reverse --check`` on a copy of only the files the patch touches.
    """
    with tempfile.TemporaryDirectory(prefix="coderl-tp-") as tmp:
        _copy_touched(snapshot, [test_patch], Path(tmp))
        return _git_apply(Path(tmp), test_patch, "--reverse", "--check")


def check_gold(task: Task, snapshot: Path) -> str:
    """``""`` when ``task`` can be graded at all, else one line why: its FAIL_TO_PASS (never
    empty, the spec checks) names only tests in files the environment (``snapshot``) or the task's own
    test files hold (pytest ids ``FILE::NAME``; other forms are not checked), and its gold patch
    applies to its starting state (``snapshot`` with ``bug_patch`` applied). A cheap check on a
    copy of the touched files with ``git apply --check``; ``coderl tasks validate`` grades the
    gold patch for real (it resolves, the bug fails)."""
    own = set(task.hidden_tests) | set(paths_in_diff(task.gold_patch))
    files = {i.split("::")[0] for i in task.FAIL_TO_PASS if "::" in i}
    absent = sorted(f for f in files if f not in own and not (snapshot / f).is_file())
    if absent:
        return f"FAIL_TO_PASS names tests in files the environment does not have: {absent[:3]}"
    with tempfile.TemporaryDirectory(prefix="coderl-gold-") as tmp:
        where = Path(tmp)
        _copy_touched(snapshot, [task.bug_patch, task.gold_patch], where)
        if task.bug_patch.strip():
            why = _git_apply(where, task.bug_patch)
            if why:
                return f"the bug patch does not apply to the environment: {why.splitlines()[-1]}"
        why = _git_apply(where, task.gold_patch, "--check")
        if not why:
            return ""
        if not task.bug_patch.strip() and not _git_apply(where, task.gold_patch, "-R", "--check"):
            return (
                "the gold patch is already in the environment's snapshot and the task has no "
                "bug_patch: it would start solved (an export keeps the bug in its 'coderl' object)"
            )
        return f"the gold patch does not apply to the task's starting state: {why.splitlines()[-1]}"


def from_instance(
    raw: dict[str, Any],
    *,
    env: EnvRecord | None = None,
    cache: Path | None = None,
    path: str | Path = "<string>",
    line: int = 1,
) -> Task:
    """One SWE-bench instance -> :class:`Task` (see the module docstring for the mapping).

    Raises:
        TaskFileError: a missing or malformed field (named), no environment for the instance
            (field ``env_id``), or a ``test_patch`` that is not in the environment's snapshot
            (field ``test_patch``).
    """
    inst = _instance(raw, path, line)
    ext = dict(inst.coderl or {})
    if "env_id" in ext:
        env_id = str(ext["env_id"])
    else:
        rec = _resolve_env(inst, env, cache)
        if rec is None:
            msg = "no built environment for this instance: pass one (--env) or build it first"
            raise TaskFileError(path, line, "env_id", msg)
        env_id = rec.env_id
        if inst.test_patch.strip():
            why = check_test_patch(inst.test_patch, Path(rec.snapshot))
            if why:
                msg = f"not in the snapshot of {env_id} (build it with the test_patch): {why}"
                raise TaskFileError(path, line, "test_patch", msg)
    known = {"instance_id", "patch", "problem_statement", "FAIL_TO_PASS", "PASS_TO_PASS"}
    known |= {"snapshot", "coderl"}
    kept = {k: v for k, v in raw.items() if k not in known}
    extra = ext.pop("extra", None)
    if extra is None:
        extra = {"swebench": kept}
    fields: dict[str, Any] = {
        "source": f"swebench:{inst.repo}" + (f"@{inst.base_commit}" if inst.base_commit else ""),
        "license": "unknown",
        **ext,
        "id": inst.instance_id,
        "kind": "repo",
        "env_id": env_id,
        "problem_statement": inst.problem_statement,
        "FAIL_TO_PASS": inst.FAIL_TO_PASS,
        "PASS_TO_PASS": inst.PASS_TO_PASS,
        "gold_patch": inst.patch,
        "extra": extra,
    }
    try:
        return Task.model_validate(fields)
    except ValidationError as e:
        first = e.errors()[0]
        field = "coderl." + ".".join(str(p) for p in first["loc"])
        raise TaskFileError(path, line, field, first["msg"]) from None


def to_instance(task: Task, *, env: EnvRecord | None = None) -> dict[str, Any]:
    """One repo :class:`Task` -> a SWE-bench instance with a ``coderl`` extension object.

    FAIL_TO_PASS / PASS_TO_PASS are written JSON-encoded, as SWE-bench ships them.

    Raises:
        ValueError: ``task`` is a function task (SWE-bench has no such kind).
    """
    if task.kind != "repo":
        raise ValueError(f"{task.id}: only repo tasks have a SWE-bench form, not {task.kind!r}")
    sw = dict(task.extra.get("swebench", {}))
    base = f"snapshot:{env.snapshot_digest}" if env else ""
    inst: dict[str, Any] = {
        "instance_id": task.id,
        "repo": sw.pop("repo", env.name if env else task.source),
        "base_commit": sw.pop("base_commit", base),
        "patch": task.gold_patch,
        "test_patch": sw.pop("test_patch", ""),
        "problem_statement": task.problem_statement,
        "hints_text": sw.pop("hints_text", ""),
        "created_at": sw.pop("created_at", ""),
        "version": sw.pop("version", env.version if env else ""),
        "environment_setup_commit": sw.pop("environment_setup_commit", ""),
        "FAIL_TO_PASS": json.dumps(task.FAIL_TO_PASS),
        "PASS_TO_PASS": json.dumps(task.PASS_TO_PASS),
        **sw,
    }
    dumped = task.model_dump(mode="json")
    skip = {"id", "kind", "problem_statement", "FAIL_TO_PASS", "PASS_TO_PASS", "gold_patch"}
    inst["coderl"] = {k: v for k, v in dumped.items() if k not in skip}
    return inst


def import_swebench(
    path: str | Path, *, env: EnvRecord | None = None, cache: Path | None = None
) -> list[Task]:
    """Read every instance of a SWE-bench-format file as a :class:`Task`.

    Raises:
        TaskFileError: the first malformed instance (file, line, field), or a duplicate id.
    """
    return _read_tasks(
        path, lambda raw, line: from_instance(raw, env=env, cache=cache, path=path, line=line)
    )


def export_swebench(tasks: list[Task], path: str | Path, *, cache: Path | None = None) -> int:
    """Write repo ``tasks`` as SWE-bench instances: a JSON array when ``path`` ends in
    ``.json``, else JSONL (gzip for ``.gz``). Returns how many were written.

    Raises:
        ValueError: a function task among ``tasks``.
    """
    envs: dict[str, EnvRecord | None] = {}
    rows = []
    for task in tasks:
        if task.env_id not in envs:
            try:
                envs[task.env_id] = find_env(task.env_id, cache=cache)
            except KeyError:  # not built here: base_commit and version stay empty
                envs[task.env_id] = None
        rows.append(to_instance(task, env=envs[task.env_id]))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with _open(tmp, "wt", gz=path.suffix == ".gz") as f:
        if path.suffix == ".json":
            f.write(json.dumps(rows, indent=1) + "\n")
        else:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    tmp.replace(path)
    return len(rows)


def image_task(
    raw: dict[str, Any],
    *,
    split: str = "train",
    namespace: str = SWEBENCH_NAMESPACE,
    path: str | Path = "<string>",
    line: int = 1,
) -> Task:
    """One instance that brings its own image -> a repo :class:`Task` with ``env_id``
    ``image:<image>`` (:func:`instance_image`; the scheme in ``namespace`` for an instance that
    names none), every instance field but the mapped ones in ``extra["swebench"]`` (the eval
    script, log parser, test patch ...) with ``image`` set to that image, no held-out tests (the
    instance's ``test_patch`` is applied only when grading, as in SWE-bench).

    Raises:
        TaskFileError: a missing or malformed field (named).
    """
    inst = _instance(raw, path, line)
    known = {"instance_id", "patch", "problem_statement", "FAIL_TO_PASS", "PASS_TO_PASS"}
    image = instance_image(raw, namespace=namespace)
    fields: dict[str, Any] = {
        "id": inst.instance_id,
        "kind": "repo",
        "env_id": IMAGE_PREFIX + image,
        "problem_statement": inst.problem_statement,
        "FAIL_TO_PASS": inst.FAIL_TO_PASS,
        "PASS_TO_PASS": inst.PASS_TO_PASS,
        "held_out_tests": [],
        "gold_patch": inst.patch,
        "source": f"swebench:{inst.repo}" + (f"@{inst.base_commit}" if inst.base_commit else ""),
        "license": "unknown",
        "split": split,
        "extra": {"swebench": {k: v for k, v in raw.items() if k not in known} | {"image": image}},
    }
    try:
        return Task.model_validate(fields)
    except ValidationError as e:
        field, msg = ".".join(str(p) for p in e.errors()[0]["loc"]), e.errors()[0]["msg"]
        raise TaskFileError(path, line, field, msg) from None


def read_image_tasks(
    path: str | Path, *, split: str = "train", namespace: str = SWEBENCH_NAMESPACE
) -> list[Task]:
    """Every instance of a SWE-bench-format file as an image task (:func:`image_task`), all in
    ``split``, images named in ``namespace`` where the instance names none.

    Raises:
        TaskFileError: the first malformed instance (file, line, field), or a duplicate id.
    """
    return _read_tasks(
        path,
        lambda raw, line: image_task(raw, split=split, namespace=namespace, path=path, line=line),
    )


def task_instance(task: Task) -> dict[str, Any]:
    """The instance an image task was read from (:func:`image_task` inverted): its
    ``extra["swebench"]`` fields with the id, test lists, gold patch and statement put back.
    Raises ValueError (not an image task)."""
    if not task.env_id.startswith(IMAGE_PREFIX):
        raise ValueError(f"{task.id}: not an image task (env_id {task.env_id!r})")
    return {
        **task.extra["swebench"],
        "instance_id": task.id,
        "patch": task.gold_patch,
        "problem_statement": task.problem_statement,
        "FAIL_TO_PASS": list(task.FAIL_TO_PASS),
        "PASS_TO_PASS": list(task.PASS_TO_PASS),
    }


FORMATS = {"swebench": (import_swebench, export_swebench)}
"""Format name -> ``(reader, writer)``; the one dispatch point of ``coderl tasks import/export``."""
