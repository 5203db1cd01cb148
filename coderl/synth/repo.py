"""Bug synthesis: inject AST mutations into covered functions and keep the ones the tests catch.

For a built environment, the per-test call trace recorded at build time says which functions each
passing test runs. Candidate mutants (``mutate.MUTATORS``) are drawn from covered functions in
seeded random order, at most ``per_function`` kept per function. A mutant is run against the
recorded passing tests in a fresh sandbox: it is kept only if at least one test fails
(FAIL_TO_PASS) and the test run completed (no crash, no timeout); every other recorded test must
still pass (PASS_TO_PASS). The problem statement is written from the failing tests' output; the
gold patch is the reverse diff of the mutation.
"""

from __future__ import annotations

import ast
import hashlib
import json
import random
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coderl.envbuild.exposure import check_readable
from coderl.grading.protected import PROTECTED_PATTERNS, is_protected
from coderl.grading.pytestcfg import run_config
from coderl.grading.runner import (
    RUN_OUTPUT_BYTES,
    SANDBOX_ENV,
    SandboxFactory,
    TestRun,
    conftests_of,
    default_factory,
    mounts,
    run_dirs,
    run_pytest,
)
from coderl.sandbox.base import Limits
from coderl.synth.mutate import Mutant, first_line, functions, mutants_of
from coderl.tasks.env import EnvRecord
from coderl.tasks.holdout import choose_held_out, held_out_source, hideable_in
from coderl.tasks.patches import make_diff, materialize
from coderl.tasks.spec import Difficulty, Task
from coderl.tasks.statement import held_out_mentions, write_statement

MAX_FILE_BYTES = 100_000
"""Files larger than this are not mutated."""


@dataclass
class Candidate:
    """A mutant with the tests that exercise its function."""

    path: str
    """Workspace-relative file."""
    mutant: Mutant
    original: str
    """The original file text."""
    covering: list[str]
    """Passing tests that call the mutated function."""
    function_lines: int


def coverage_map(env: EnvRecord) -> dict[tuple[str, int], list[str]]:
    """(file, first line of function) -> passing tests that call it, from the build-time trace."""
    trace = json.loads((Path(env.venv).parent / "trace.json").read_text())
    passing = set(env.passing)
    covered: dict[tuple[str, int], list[str]] = defaultdict(list)
    for test_id, calls in trace.items():
        if test_id in passing:
            for rel, line in calls:
                covered[(rel, line)].append(test_id)
    return covered


def candidates(env: EnvRecord, rng: random.Random) -> Iterator[Candidate]:
    """Mutants of covered, non-test functions, in seeded random order (function, then site)."""
    covered = coverage_map(env)
    snapshot = Path(env.snapshot)
    by_file: dict[str, list[int]] = defaultdict(list)
    for rel, line in covered:
        if rel.endswith(".py") and not is_protected(rel, PROTECTED_PATTERNS):
            by_file[rel].append(line)
    fns: list[tuple[str, str, ast.FunctionDef | ast.AsyncFunctionDef, str]] = []
    for rel in sorted(by_file):
        if (snapshot / rel).stat().st_size > MAX_FILE_BYTES:
            continue  # generated tables (e.g. idna's uts46data.py), not code a person writes
        source = (snapshot / rel).read_text(encoding="utf-8")
        lines = set(by_file[rel])
        for qualname, fn in functions(ast.parse(source)):
            if first_line(fn) in lines:
                fns.append((rel, qualname, fn, source))
    rng.shuffle(fns)
    for rel, qualname, fn, source in fns:
        mutants = _interleave_operators(list(mutants_of(source, qualname, fn)), rng)
        size = (fn.end_lineno or fn.lineno) - fn.lineno + 1
        for m in mutants:
            yield Candidate(rel, m, source, covered[(rel, first_line(fn))], size)


def _interleave_operators(mutants: list[Mutant], rng: random.Random) -> list[Mutant]:
    """Shuffle, then alternate operators, so that common ones (every ``return`` offers
    ``wrong_return``) do not crowd out the rest."""
    groups: dict[str, list[Mutant]] = defaultdict(list)
    for m in mutants:
        groups[m.operator].append(m)
    order = sorted(groups)
    rng.shuffle(order)
    for name in order:
        rng.shuffle(groups[name])
    out: list[Mutant] = []
    while any(groups.values()):
        for name in order:
            if groups[name]:
                out.append(groups[name].pop())
    return out


def _run(
    env: EnvRecord, base: Path, select: list[str], factory: SandboxFactory, timeout: float
) -> TestRun:
    limits = Limits(
        timeout_s=timeout,
        cpu_s=int(timeout) + 30,
        memory_bytes=4 * 1024**3,
        output_bytes=RUN_OUTPUT_BYTES,
    )
    with run_dirs() as inp:
        ro = mounts(inp, Path(env.venv))
        sb = factory(
            base, limits=limits, env=SANDBOX_ENV, ro_mounts=ro, rw_mounts={}, network=False
        )
        try:
            return run_pytest(
                sb,
                inp,
                allowed_conftests=conftests_of(base),
                paths=env.test_paths,
                select=select,
                canaries=False,
                timeout=timeout,
                inifile=run_config(base, env.info.get("pytest_config"), env.test_paths),
            )
        finally:
            sb.close()


def statement_for(
    repo: str, f2p: list[str], held_out: list[str], longreprs: dict[str, str], snapshot: Path
) -> str:
    """The problem statement of a task: visible failing tests' output, held-out ones' symptoms
    only. Raises ValueError if it would still name or quote a held-out test (a bug here)."""
    source = held_out_source(snapshot, held_out)
    # A visible id that shares a held-out function's name (an inherited copy of a blanked
    # method, say) would name it: it is left unnamed too.
    hidden = {t for t in f2p if t in held_out or held_out_mentions(t, held_out)}
    statement = write_statement(
        repo,
        {t: longreprs.get(t, "") for t in f2p if t not in hidden},
        held_out={t: longreprs.get(t, "") for t in f2p if t in hidden},
        held_out_source=source,
    )
    leaked = held_out_mentions(statement, held_out, source)
    if leaked:
        raise ValueError(f"problem statement reveals held-out tests: {leaked[:3]}")
    return statement


def try_candidate(
    env: EnvRecord, cand: Candidate, factory: SandboxFactory, *, timeout: float = 60.0
) -> Task | str:
    """Run the mutant's tests; a :class:`Task` if it is kept, else the reason it was rejected."""
    bug_patch = make_diff(cand.path, cand.original, cand.mutant.source)
    base = materialize(Path(env.snapshot), bug_patch)
    if len(cand.covering) < len(env.passing):  # cheap filter: only the covering tests
        quick = _run(env, base, cand.covering, factory, timeout)
        if quick.results_missing:
            return "test run crashed or timed out"
        if all(quick.passed(t) for t in cand.covering):
            return "no test fails (equivalent or untested mutant)"
    run = _run(env, base, env.passing, factory, timeout)
    if run.results_missing:
        return "test run crashed or timed out"
    if not run.outcomes:
        code = run.exec.exit_code if run.exec else "?"
        return f"no test reported (pytest exit code {code})"
    f2p = [t for t in env.passing if not run.passed(t)]
    p2p = [t for t in env.passing if run.passed(t)]
    if not f2p:
        return "no test fails (equivalent or untested mutant)"
    if not p2p:
        return "every test fails (the mutant breaks import)"
    gold = make_diff(cand.path, cand.mutant.source, cand.original)
    digest = hashlib.sha256(bug_patch.encode()).hexdigest()[:10]
    task_id = f"{env.name}-{env.version}/{digest}"
    held_out = choose_held_out(task_id, f2p, p2p, hideable_in(Path(env.snapshot)))
    try:
        statement = statement_for(
            f"{env.name} {env.version}", f2p, held_out, run.longreprs, Path(env.snapshot)
        )
    except ValueError as e:
        return str(e)
    return Task(
        id=task_id,
        kind="repo",
        env_id=env.env_id,
        problem_statement=statement,
        FAIL_TO_PASS=f2p,
        PASS_TO_PASS=p2p,
        held_out_tests=held_out,
        bug_patch=bug_patch,
        gold_patch=gold,
        protected_paths=[f"{p}/**" if not p.endswith(".py") else p for p in env.test_paths],
        difficulty=Difficulty(
            mutation=cand.mutant.operator,
            lines_changed=sum(
                1 for ln in gold.splitlines() if ln[:1] in "+-" and ln[:3] not in ("+++", "---")
            ),
            function_lines=cand.function_lines,
            n_fail_to_pass=len(f2p),
        ),
        source=f"pypi:{env.spec}" if "==" in env.spec else f"local:{env.name}",
        license=env.license,
        extra={"file": cand.path, "function": cand.mutant.function, "line": cand.mutant.line},
    )


def synthesize(
    env: EnvRecord,
    n: int,
    *,
    seed: int = 0,
    per_function: int = 2,
    max_tries: int | None = None,
    factory: SandboxFactory | None = None,
    log: bool = False,
    on_task: Callable[[Task], None] | None = None,
) -> tuple[list[Task], dict[str, int]]:
    """Up to ``n`` kept tasks for ``env``; returns ``(tasks, rejection reason -> count)``.

    ``on_task`` is called with each kept task as soon as it is kept (for incremental saving).
    Raises ExposureError when a rollout sandbox of ``env`` can read a pristine copy of its
    source (``coderl.envbuild.exposure``): no task is made from a bug that a copy undoes.
    """
    factory = factory or default_factory()
    snapshot = Path(env.snapshot)
    check_readable(snapshot, {"/venv": env.venv}, snapshot, factory=factory)  # ExposureError
    rng = random.Random(seed)
    tasks: list[Task] = []
    rejected: dict[str, int] = defaultdict(int)
    per_fn: dict[tuple[str, str], int] = defaultdict(int)
    seen: set[str] = set()
    tries = 0
    for cand in candidates(env, rng):
        key = (cand.path, cand.mutant.function)
        if len(tasks) >= n or (max_tries is not None and tries >= max_tries):
            break
        if per_fn[key] >= per_function or cand.mutant.source in seen:
            continue
        seen.add(cand.mutant.source)
        tries += 1
        outcome = try_candidate(env, cand, factory)
        if isinstance(outcome, str):
            rejected[outcome] += 1
        else:
            tasks.append(outcome)
            per_fn[key] += 1
            if on_task is not None:
                on_task(outcome)
        if log:
            what = "kept" if isinstance(outcome, Task) else f"rejected: {outcome}"
            print(
                f"[{len(tasks)}/{n}] {cand.path}:{cand.mutant.line} {cand.mutant.operator} {what}",
                flush=True,
            )
    return tasks, dict(rejected)


def synthesise_ladder(request: dict[str, Any]) -> dict[str, Any]:
    """One in-loop synthesis request for the repository ladder (``tasks.synth.proposer: repo``,
    :mod:`coderl.train.synth`): new bugs in one training repository (:func:`synthesize`, which
    keeps a mutant only when its tests run and some of them fail), each made the ladder variant
    at ``request["level"]`` (:func:`coderl.tasks.ladder.ladder_task`, checked against the
    held-out tests' names and source). The repository is drawn with
    ``random.Random(request["key"])`` from ``request["repos"]`` (empty: every ``train``
    repository of ``data/repos.txt`` with a built environment); at most ``request["max_tries"]``
    candidates are run. Variants whose id is in ``request["exclude"]`` are dropped. Returns
    ``{"proposed": candidates run, "tasks": [task JSON], "seconds": wall time}``; deterministic
    in the request (and the built environments).

    Raises:
        ValueError: a requested repository is held out, or none is built.
    """
    from coderl.tasks.env import find_env
    from coderl.tasks.ladder import ladder_task
    from coderl.tasks.repos import read_repos

    t0 = time.perf_counter()
    pins = {p.name: p for p in read_repos()}
    names = list(request.get("repos") or [p.name for p in pins.values() if p.split == "train"])
    held = [n for n in names if n not in pins or pins[n].split != "train"]
    if held:
        raise ValueError(f"tasks.synth.repos: {held} are not training repositories")
    envs: list[EnvRecord] = []
    for name in names:
        try:
            envs.append(find_env(pins[name].spec))
        except KeyError:
            if request.get("repos"):
                raise ValueError(f"tasks.synth.repos: {name} has no built environment") from None
    if not envs:
        raise ValueError("repository synthesis: no training repository has a built environment")
    rng = random.Random(request["key"])
    env = envs[rng.randrange(len(envs))]
    kept, rejected = synthesize(
        env,
        int(request["n"]),
        seed=rng.randrange(2**31),
        max_tries=int(request.get("max_tries", 40)),
    )
    exclude = set(request.get("exclude", ()))
    out = []
    for task in kept:
        source = held_out_source(Path(env.snapshot), task.held_out_tests)
        try:
            variant = ladder_task(task, int(request["level"]), source)
        except ValueError:
            continue  # this bug cannot be stated at the level (two edits for L0, say)
        if variant.id not in exclude:
            out.append(variant.model_dump(mode="json"))
    proposed = len(kept) + sum(rejected.values())
    return {"proposed": proposed, "tasks": out, "seconds": time.perf_counter() - t0}
