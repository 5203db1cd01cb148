"""The pinned repositories (``data/repos.txt``), their split, and the repository task source.

``data/repos.txt`` is the one place that says which real repositories coderl ships tasks for,
under which licence, and whether each is a **training** or a **held-out** repository. The split
is by repository, not by task: every task of a held-out library is evaluated and never trained
on, so a held-out score measures fixing bugs in code the policy has not seen (a split by task
would let training read the same files, functions and tests the evaluation then asks about).
One line per repository, ``#`` starts a comment::

    NAME==VERSION  SPLIT  LICENCE      # SPLIT: train | heldout; LICENCE: SPDX expression

:func:`load_repo_tasks` is what the ``repo`` task source (``tasks.source: repo``) calls for
``tasks.train_split`` and ``tasks.heldout_split``: by default it reads every shipped
``data/tasks/*.jsonl.gz`` file. The split of a task whose repository is pinned is that
repository's split (a task file's own ``split`` field cannot move a held-out library into
training); tasks of repositories that are not pinned keep their own ``split`` field. Tasks come
out round-robin over repositories (sorted by name), so the first ``eval.tasks`` of a split cover
every repository of it.

:func:`per_repo_report` turns an evaluation's per-task counts into resolved rate and fraction of
FAIL_TO_PASS tests passed per repository, each with a bootstrap 95% CI over tasks.
"""

from __future__ import annotations

import glob
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from coderl.stats import estimate
from coderl.tasks.snapshot import parse_spec
from coderl.tasks.spec import Task, load_tasks
from coderl.tasks.swebench import IMAGE_PREFIX

DATA_DIR = Path(__file__).resolve().parent.parent.parent / "data"
"""The checkout's ``data/`` directory (the repository list and the shipped task files)."""
REPOS_FILE = DATA_DIR / "repos.txt"
TASKS_GLOB = str(DATA_DIR / "tasks" / "*.jsonl.gz")
"""The shipped task files; ``data/tasks/ci.jsonl`` (a copy of four six tasks for CI) is not
among them."""
SPLITS = ("train", "heldout")


@dataclass(frozen=True)
class RepoPin:
    """One line of ``data/repos.txt``."""

    spec: str
    """``NAME==VERSION`` (an sdist on PyPI), what ``coderl tasks build-env`` builds."""
    name: str
    version: str
    split: str
    """``train`` or ``heldout`` (``outside`` in ``data/fnrepair/outside.txt``): every task of this
    repository is in this split."""
    license: str
    """SPDX licence expression of the repository (read from its sdist's licence file); the
    shipped tasks' ``license`` field carries the same string."""


def read_repos(path: str | Path = REPOS_FILE, splits: Sequence[str] = SPLITS) -> list[RepoPin]:
    """Parse a repository list whose lines may name the ``splits`` (``data/repos.txt``: train or
    heldout; ``data/fnrepair/outside.txt``: outside).

    Raises:
        ValueError: a line without ``NAME==VERSION SPLIT LICENCE``, an unknown split, or a
            repository listed twice (message: file, line).
    """
    pins: list[RepoPin] = []
    seen: set[str] = set()
    for number, raw in enumerate(Path(path).read_text().splitlines(), start=1):
        fields = raw.split("#")[0].split()
        if not fields:
            continue
        where = f"{path}:{number}"
        pinned = parse_spec(fields[0])
        if len(fields) < 3 or pinned is None:
            raise ValueError(f"{where}: expected 'NAME==VERSION SPLIT LICENCE', got {raw!r}")
        if fields[1] not in splits:
            raise ValueError(f"{where}: split {fields[1]!r}; valid: {list(splits)}")
        name, version = pinned
        if name in seen:
            raise ValueError(f"{where}: {name} is listed twice")
        seen.add(name)
        pins.append(RepoPin(fields[0], name, version, fields[1], " ".join(fields[2:])))
    return pins


def repo_of(task: Task) -> str:
    """The repository a repo task comes from: ``NAME`` of ``pypi:NAME==VERSION``; for an
    instance that brings its own image, its ``repo`` field (``owner/name``); else the
    ``NAME-VERSION`` prefix of its id (``local:`` and imported tasks)."""
    if getattr(task, "env_id", "").startswith(IMAGE_PREFIX):  # reports take task-like rows too
        return str(task.extra.get("swebench", {}).get("repo") or task.id)
    pinned = parse_spec(task.source.removeprefix("pypi:"))
    if pinned is not None:
        return pinned[0]
    return task.id.split("/")[0]


def split_of(task: Task, pins: dict[str, RepoPin]) -> str:
    """The split of ``task``: its repository's when pinned, else its own ``split`` field."""
    pin = pins.get(repo_of(task))
    return pin.split if pin is not None else task.split


def stamp(task: Task, pins: dict[str, RepoPin]) -> Task:
    """``task`` with its pinned repository's split and licence written into its ``split`` and
    ``license`` fields (unchanged when the repository is not pinned): what ``coderl tasks synth``
    saves, so a shipped file's fields agree with ``data/repos.txt`` (and travel with an export)."""
    pin = pins.get(repo_of(task))
    if pin is None:
        return task
    return task.model_copy(update={"split": pin.split, "license": pin.license})


def pinned(path: str | Path | None = None, splits: Sequence[str] = SPLITS) -> dict[str, RepoPin]:
    """``{name: RepoPin}`` of a repository list (default ``data/repos.txt``), see
    :func:`read_repos`."""
    return {p.name: p for p in read_repos(path or REPOS_FILE, splits)}


def task_files(patterns: str | Sequence[str] | None = None) -> list[Path]:
    """Task files named by ``patterns`` (paths or globs; default the shipped files).

    Raises:
        FileNotFoundError: a pattern matches no file.
    """
    if patterns is None:
        patterns = [TASKS_GLOB]
    elif isinstance(patterns, str):
        patterns = [patterns]
    files: list[Path] = []
    for pattern in patterns:
        matched = sorted(glob.glob(str(pattern)))
        if not matched:
            raise FileNotFoundError(f"no task file matches {pattern!r}")
        files += [Path(m) for m in matched]
    return files


def round_robin(tasks: list[Task]) -> list[Task]:
    """Interleave tasks by repository (repositories sorted by name, each in its file order)."""
    by_repo: dict[str, list[Task]] = defaultdict(list)
    for task in tasks:
        by_repo[repo_of(task)].append(task)
    queues = [by_repo[name] for name in sorted(by_repo)]
    out: list[Task] = []
    for i in range(max((len(q) for q in queues), default=0)):
        out += [q[i] for q in queues if i < len(q)]
    return out


def load_repo_tasks(
    split: str,
    *,
    tasks_file: str | Sequence[str] | None = None,
    repos_file: str | Path | None = None,
) -> list[Task]:
    """The repo tasks of ``split`` (``train`` or ``heldout``), round-robin over repositories.

    ``tasks_file``: a path, glob or list of them (default: every shipped ``data/tasks/*.jsonl.gz``);
    ``repos_file``: the repository list that decides the split (default ``data/repos.txt``).

    Raises:
        ValueError: an unknown split, a non-repo task, or a task id in two files.
        FileNotFoundError: a ``tasks_file`` pattern matches nothing.
        TaskFileError: a malformed task file.
    """
    if split not in SPLITS:
        raise ValueError(f"repo tasks: unknown split {split!r}; valid: {list(SPLITS)}")
    pins = pinned(repos_file)
    chosen: list[Task] = []
    where: dict[str, Path] = {}
    for path in task_files(tasks_file):
        for task in load_tasks(path):
            if task.kind != "repo":
                raise ValueError(f"{path}: {task.id} is a {task.kind} task, not a repo task")
            if task.id in where:
                raise ValueError(f"task {task.id} is in both {where[task.id]} and {path}")
            where[task.id] = path
            if split_of(task, pins) == split:
                chosen.append(task)
    return round_robin(chosen)


def per_repo_report(per_task: list[dict[str, Any]], tasks: list[Task]) -> dict[str, Any]:
    """Resolved rate and FAIL_TO_PASS fraction per repository, each a mean over tasks with a
    percentile-bootstrap 95% CI over tasks (:func:`coderl.stats.estimate`).

    Args:
        per_task: :class:`coderl.eval.passk.EvalResult` ``per_task`` rows: ``task_id``, ``n``
            (samples), ``correct`` (resolved samples) and ``f2p`` (mean over the samples of the
            fraction of FAIL_TO_PASS tests that passed; 0 for a failed or missing sample).
        tasks: the evaluated tasks (to find each row's repository).

    Returns:
        ``{repo: {"tasks": int, "resolved": {mean, lo, hi}, "fail_to_pass": {mean, lo, hi}}}``,
        repositories sorted by name. A task's resolved value is ``correct / n`` (its pass@1).

    Raises:
        KeyError: a row whose task is not in ``tasks``.
    """
    repo = {t.id: repo_of(t) for t in tasks}
    rows: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in per_task:
        rows[repo[row["task_id"]]].append(row)
    return {
        name: {
            "tasks": len(group),
            "resolved": asdict(estimate([r["correct"] / r["n"] for r in group])),
            "fail_to_pass": asdict(estimate([float(r["f2p"]) for r in group])),
        }
        for name, group in sorted(rows.items())
    }


def print_per_repo(report: dict[str, Any], *, file: Any = None) -> None:
    """Print :func:`per_repo_report` as a table (to stderr unless ``file`` is given)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="per repository (mean over tasks, 95% bootstrap CI)")
    for col in ("repository", "tasks", "resolved", "FAIL_TO_PASS passed"):
        table.add_column(col)

    def cell(e: dict[str, float]) -> str:
        return f"{e['mean']:.3f} [{e['lo']:.3f}, {e['hi']:.3f}]"

    for name, row in report.items():
        table.add_row(name, str(row["tasks"]), cell(row["resolved"]), cell(row["fail_to_pass"]))
    Console(file=file, stderr=file is None, width=100).print(table)
