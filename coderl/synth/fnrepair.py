"""Function-scope repair tasks: a real, correct function with bugs injected, the failing check's
output shown, the repair graded by the function's real tests.

The published form is HumanEvalFix (Muennighoff et al., 2023, "OctoPack: Instruction Tuning Code
Large Language Models", section 3, HumanEvalPack): HumanEval's canonical solutions with a bug
inserted by hand, graded by HumanEval's tests. Here the bugs come from :mod:`coderl.synth.mutate`
(so there can be as many as the mutation sites allow) and the functions also come from the
libraries of ``data/repos.txt`` (:mod:`coderl.tasks.fnseeds`). The context is the one file, small
enough for a 135M model: no repository.

A task is a ``function`` task (:class:`coderl.tasks.spec.Task`): ``solution.py`` holds the buggy
file, the hidden test is the seed's ``check(candidate)`` (never in the workspace), the gold patch
restores the original. It is graded like every function task, by
:func:`coderl.grading.grade.grade` (which runs :func:`coderl.tasks.humaneval.grade_function`:
candidate and judge in separate sandboxes). The statement shows the buggy file and what the check
printed on it, computed in a sandbox (:func:`symptom`).

Difficulty knobs (:class:`Knobs`), recorded in ``task.extra["fnrepair"]`` with their ``level``:
the mutation kind (``plain`` operators flip a whole condition or return value; ``subtle`` ones
move a boundary, an index, an operator or an argument), the number of mutations (1-2), the distance
of the fault from the symptom (0: the bug is in the function the check calls; 1: in a helper it
calls), and whether the failing assertion is shown (else only the error). ``level`` is the count of
hard settings (0-4).

Validation (:func:`validate`): in fresh sandboxes, the gold patch must resolve the task and the
unedited buggy file must not. Held-out tasks come only from held-out seeds (HumanEval's fixed split,
the held-out libraries of ``data/repos.txt``); ``outside`` tasks only from the kept-back libraries
of ``data/fnrepair/outside.txt``, in their own file (``OUTSIDE_FILE``).

The *visible check* of a task (:func:`shown_check`) is the failing assertion its statement shows,
as a ``check(candidate)`` of its own: the one test the agent can see. :func:`visible_potential`
judges the episode's workspace with it exactly as the hidden check is judged (the same
out-of-process checker, fresh sandboxes), so nothing the agent prints counts; it is the shaping
potential of ``reward.shaping`` (:mod:`coderl.rewards.shaping`). Tasks whose statement shows no
assertion (``show_assertion`` off), or whose assertion names what only the hidden check defines
(a loop variable), have none.

Not defended: a mutant can be equivalent on every input the check tries but not in general (the
validation then drops it, since the buggy file passes); the symptom is one failing assertion (the
first), not the check's whole output; a file that special-cases the visible check's input passes
it (its potential rises; the hidden check still decides the reward).
"""

from __future__ import annotations

import ast
import builtins
import functools
import hashlib
import random
import re
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from coderl.sandbox.base import DIFF_FAULTS
from coderl.synth.fnlookup import lookup_passes
from coderl.synth.mutate import MUTATORS, Mutant, functions, mutants_of
from coderl.tasks.fnseeds import Seed, run_script, top_level_calls
from coderl.tasks.patches import make_diff
from coderl.tasks.repos import DATA_DIR, round_robin
from coderl.tasks.spec import Difficulty, Task, load_tasks

TASKS_FILE = DATA_DIR / "fnrepair" / "tasks.jsonl.gz"
"""The shipped, validated task file (``python -m coderl.synth.fnrepair_build``)."""
OUTSIDE_FILE = DATA_DIR / "fnrepair" / "outside.jsonl.gz"
"""The kept-back set (split ``outside``): repair tasks built the same way from libraries the
family never uses (``data/fnrepair/outside.txt``; ``python -m coderl.synth.fnrepair_build
outside``). Only evaluated (``eval.extra_splits``), never trained on."""
KINDS: dict[str, tuple[str, ...]] = {
    "plain": (
        "flip_comparison",
        "negate_condition",
        "wrong_return",
        "swap_bool_op",
        "flip_bool_constant",
    ),
    "subtle": (
        "boundary_comparison",
        "off_by_one_range",
        "off_by_one_index",
        "off_by_one_constant",
        "swap_arithmetic",
        "swap_arguments",
        "drop_condition",
        "remove_statement",
    ),
}
"""Mutation kind -> the ``mutate.MUTATORS`` operators of that kind (every operator is in one)."""
assert sorted(sum(KINDS.values(), ())) == sorted(MUTATORS)
SYMPTOM_TIMEOUT_S = 5
MAX_LEVEL = 4


@dataclass(frozen=True)
class Knobs:
    """The difficulty settings of one repair task (module docstring)."""

    kind: str = "plain"
    """A key of ``KINDS``."""
    n_mutations: int = 1
    """Bugs injected (1 or 2), at different sites."""
    distance: int = 0
    """0: a bug in the function the check calls; 1: in a top-level helper it calls."""
    show_assertion: bool = True
    """The statement shows the failing assertion line (else only the error it raised)."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"knobs.kind: unknown {self.kind!r}; valid: {sorted(KINDS)}")
        if self.n_mutations not in (1, 2) or self.distance not in (0, 1):
            raise ValueError(f"knobs: n_mutations must be 1-2, distance 0-1, got {self}")

    @property
    def level(self) -> int:
        """How many knobs are at their hard setting (0-4)."""
        hard = (self.kind == "subtle", self.n_mutations == 2, self.distance == 1)
        return sum(hard) + (not self.show_assertion)


def knobs_at(level: int, rng: random.Random, *, helpers: bool = True) -> Knobs | None:
    """Random knobs of difficulty ``level`` (0-4): which knobs are hard is drawn by ``rng``;
    without ``helpers`` (the seed's function calls none) the distance stays 0, and ``None`` comes
    back for level 4.

    Raises:
        ValueError: a level outside 0-4.
    """
    if not 0 <= level <= MAX_LEVEL:
        raise ValueError(f"difficulty level {level}: valid 0-{MAX_LEVEL}")
    choices = [0, 1, 2, 3] if helpers else [0, 1, 3]
    if level > len(choices):
        return None
    hard = set(rng.sample(choices, level))
    return Knobs(
        "subtle" if 0 in hard else "plain", 2 if 1 in hard else 1, int(2 in hard), 3 not in hard
    )


def level_of(task: Task) -> int | None:
    """The difficulty level a repair task records, ``None`` for other tasks (any object)."""
    info = (getattr(task, "extra", None) or {}).get("fnrepair")
    return int(info["level"]) if info else None


def _mutants(code: str, name: str, kind: str) -> list[Mutant]:
    tree = ast.parse(code)
    fn = next((f for q, f in functions(tree) if q == name), None)
    if fn is None:
        return []
    return [m for m in mutants_of(code, name, fn) if m.operator in KINDS[kind]]


def helpers_of(seed: Seed) -> list[str]:
    """The seed's top-level helpers its entry point calls and its check does not name: a bug
    there is one call away from the symptom, and the judge (whose globals are the task's file,
    :mod:`coderl.grading.function`) never builds inputs with the buggy helper."""
    used = {n.id for n in ast.walk(ast.parse(seed.test)) if isinstance(n, ast.Name)}
    return [h for h in top_level_calls(seed.code, seed.entry_point) if h not in used]


def inject(seed: Seed, knobs: Knobs, rng: random.Random) -> tuple[str, list[Mutant]] | None:
    """The seed's file with ``knobs.n_mutations`` bugs of ``knobs.kind`` in the function
    ``knobs.distance`` names (a second bug at another line), or ``None`` when the seed has no
    such site (no :func:`helpers_of` for distance 1, no applicable operator)."""
    if knobs.distance == 0:
        target = seed.entry_point
    else:
        helpers = helpers_of(seed)
        if not helpers:
            return None
        target = rng.choice(helpers)
    code, done = seed.code, []
    for _ in range(knobs.n_mutations):
        taken = {m.line for m in done}
        options = [m for m in _mutants(code, target, knobs.kind) if m.line not in taken]
        if not options:
            return None
        pick = rng.choice(options)
        code, done = pick.source, [*done, pick]
    return code, done


_SYMPTOM = """
import ast, json, signal, sys, traceback
def alarm(*_):
    raise TimeoutError(f"the check took more than {TIMEOUT} s")
ns = {}
out = {}
try:
    exec(compile(open('solution.py').read(), 'solution.py', 'exec'), ns)
    g = dict(ns)
    exec(compile(open('hidden_test.py').read(), 'hidden_test.py', 'exec'), g)
    signal.signal(signal.SIGALRM, alarm)
    signal.alarm(TIMEOUT)
    g['check'](ns[sys.argv[1]])
    out['passed'] = True
except BaseException as e:
    signal.alarm(0)
    frames = traceback.extract_tb(e.__traceback__)
    test = [f for f in frames if f.filename == 'hidden_test.py']
    out['error'] = (type(e).__name__ + ': ' + str(e)).strip().rstrip(':')[:300]
    out['in_solution'] = [[f.lineno, f.line] for f in frames if f.filename == 'solution.py'][-3:]
    if test:
        src = open('hidden_test.py').read()
        node = next((n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.stmt)
                     and not hasattr(n, 'body') and n.lineno == test[-1].lineno), None)
        out['line'] = (ast.get_source_segment(src, node) if node else test[-1].line)[:400]
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != 'hidden_test.py':
            tb = tb.tb_next
        while tb is not None and tb.tb_next is not None and \\
                tb.tb_next.tb_frame.f_code.co_filename == 'hidden_test.py':
            tb = tb.tb_next
        if isinstance(e, AssertionError) and isinstance(node, ast.Assert) and \\
                isinstance(node.test, ast.Compare) and tb is not None:
            signal.alarm(TIMEOUT)
            try:
                got = eval(compile(ast.Expression(node.test.left), 'got', 'eval'),
                           tb.tb_frame.f_globals, dict(tb.tb_frame.f_locals))
                out['got'] = repr(got)[:300]
            except BaseException as e2:
                out['got'] = 'raised ' + type(e2).__name__
            finally:
                signal.alarm(0)
print('RESULT ' + json.dumps(out))
"""


def symptom(code: str, test: str, entry: str) -> dict[str, object]:
    """What the check reports on ``code``, run in a sandbox: ``{"passed": True}`` or
    ``{"error", "line" (the failing line of the check), "got" (the left side of a failing
    ``==`` assertion), "in_solution" (the last solution.py frames: line, text)}``.

    Raises:
        RuntimeError: the sandbox printed no result (infrastructure).
    """
    files = {
        "solution.py": code,
        "hidden_test.py": test,  # traceback lines are read from it
        "symptom.py": _SYMPTOM.replace("TIMEOUT", str(SYMPTOM_TIMEOUT_S)),
    }
    result, stderr = run_script(files, "symptom.py", entry, SYMPTOM_TIMEOUT_S * 3)
    if result is None:
        raise RuntimeError(f"the symptom run printed nothing: {stderr[-300:]}")
    return dict(result)


def render_symptom(sym: dict[str, object], show_assertion: bool) -> str:
    """The failing-test text of a statement: the error, where it was raised in solution.py, and,
    with ``show_assertion``, the failing assertion line and what its left side evaluated to."""
    lines = []
    if show_assertion and sym.get("line"):
        lines.append(f"    {str(sym['line']).strip()}")
    lines.append(str(sym.get("error") or "AssertionError"))
    if show_assertion and sym.get("got") is not None:
        lines.append(f"(the left side evaluated to {sym['got']})")
    for lineno, text in sym.get("in_solution") or []:  # type: ignore[attr-defined]
        lines.append(f'  File "solution.py", line {lineno}: {str(text).strip()}')
    return "\n".join(lines)


def statement(buggy: str, entry: str, symptom_text: str) -> str:
    """The task text: the buggy file and the failing test's output."""
    return (
        f"The function `{entry}` in solution.py has a bug: a hidden test fails.\n\n"
        f"```python\n{buggy}```\n\nThe failing test reports:\n```\n{symptom_text}\n```\n\n"
        "Fix the bug in solution.py. Keep the function's name and signature; the hidden tests "
        "are not in your workspace."
    )


_SHOWN = re.compile(r"The failing test reports:\n```\n(.*?)\n```", re.S)


def shown_check(task: Any) -> str | None:
    """The task's visible check: ``def check(candidate):`` around the failing assertion that its
    statement shows (read from the statement, so it holds nothing the agent was not shown), or
    ``None`` when the statement shows none (``show_assertion`` off, not a repair statement), or
    the assertion names something neither ``candidate``, a builtin nor the workspace's
    ``solution.py`` defines (the check's own locals: the shown line cannot run alone)."""
    m = _SHOWN.search(getattr(task, "problem_statement", ""))
    files = getattr(task, "workspace_files", {})
    lines = m.group(1).split("\n") if m else []
    if not lines or not lines[0].startswith("    ") or "solution.py" not in files:
        return None
    for i in range(1, len(lines) + 1):  # the shortest prefix that is one statement
        src = "\n".join(lines[:i]).strip()
        try:
            body = ast.parse(src).body
        except SyntaxError:
            continue
        if len(body) != 1 or not isinstance(body[0], ast.Assert):
            return None
        known = {"candidate", *dir(builtins), *_top_level_names(files["solution.py"])}
        for node in ast.walk(body[0]):  # names bound inside the assertion itself
            if isinstance(node, ast.comprehension):
                known |= {n.id for n in ast.walk(node.target) if isinstance(n, ast.Name)}
            elif isinstance(node, ast.Lambda):
                known |= {a.arg for a in ast.walk(node.args) if isinstance(a, ast.arg)}
        used = {n.id for n in ast.walk(body[0]) if isinstance(n, ast.Name)}
        return f"def check(candidate):\n    {src}\n" if used <= known else None
    return None


def _top_level_names(code: str) -> set[str]:
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return set()
    out: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            out |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return out


def visible_potential(task: Any, sandbox: Any) -> float | None:
    """``Phi`` of the episode's current workspace: 1.0 when its ``sandbox.diff()`` passes the
    task's :func:`shown_check`, judged by :func:`coderl.grading.grade.grade` in fresh sandboxes
    (the candidate's answers computed apart from the judge, as for the hidden check), else 0.0;
    ``None`` when the task has no visible check or the grader could not run (infrastructure, or
    a workspace whose diff cannot be taken): the potential is then unknown.

    The hidden tests never take part: the judged check is the shown assertion alone."""
    check = shown_check(task)
    if check is None:
        return None
    from coderl.grading.grade import grade

    try:
        diff = sandbox.diff()
    except DIFF_FAULTS:  # no diff, no potential; the episode's own end says why
        return None
    visible = task.model_copy(update={"hidden_tests": {"hidden_test.py": check}})
    g = grade(visible, diff, timeout=2 * SYMPTOM_TIMEOUT_S)
    return None if g.grading_error else float(g.resolved)


def make_task(seed: Seed, knobs: Knobs, rng: random.Random) -> Task | None:
    """One repair task from ``seed`` at ``knobs`` (not yet validated), or ``None`` when no bug can
    be injected that way or the buggy file passes its check (an equivalent mutant).

    Raises:
        RuntimeError: the symptom sandbox gave no result (infrastructure).
    """
    injected = inject(seed, knobs, rng)
    if injected is None:
        return None
    buggy, mutants = injected
    sym = symptom(buggy, seed.test, seed.entry_point)
    if sym.get("passed"):
        return None
    digest = hashlib.sha256(f"{buggy}\0{knobs}".encode()).hexdigest()[:10]
    gold = make_diff("solution.py", buggy, seed.code)
    info = {
        **asdict(knobs),
        "level": knobs.level,
        "seed": seed.id,
        "operators": [m.operator for m in mutants],
        "lines": [m.line for m in mutants],
    }
    return Task(
        id=f"fnrepair/{seed.id}/{digest}",
        kind="function",
        env_id="python3",
        problem_statement=statement(
            buggy, seed.entry_point, render_symptom(sym, knobs.show_assertion)
        ),
        FAIL_TO_PASS=["hidden_test.py::check"],
        hidden_tests={"hidden_test.py": seed.test},
        gold_patch=gold,
        workspace_files={"solution.py": buggy},
        difficulty=Difficulty(
            mutation=mutants[0].operator,
            lines_changed=sum(
                ln[:1] in "+-" and ln[:3] not in ("+++", "---") for ln in gold.splitlines()
            ),
            function_lines=len(seed.code.splitlines()),
            n_fail_to_pass=1,
        ),
        source=seed.source,
        license=seed.license,
        split=seed.split,  # type: ignore[arg-type]
        extra={"entry_point": seed.entry_point, "gold_file": seed.code, "fnrepair": info},
    )


def make_task_at(seed: Seed, level: int, rng: random.Random) -> Task | None:
    """:func:`make_task` with knobs drawn at ``level`` (:func:`knobs_at`), or ``None``."""
    knobs = knobs_at(level, rng, helpers=bool(helpers_of(seed)))
    return None if knobs is None else make_task(seed, knobs, rng)


def validate(task: Task, *, timeout: float = 30.0) -> str | None:
    """``None`` when, each in fresh sandboxes, the gold patch resolves ``task``, the unedited
    buggy file does not, and no lookup of the inputs the statement and workspace show passes
    the check (:func:`coderl.synth.fnlookup.lookup_passes`: the statement cannot let a table of
    shown answers beside the bug earn the reward); else why not (one line)."""
    from coderl.grading.grade import grade

    gold = grade(task, task.gold_patch, timeout=timeout)
    if gold.grading_error or not gold.resolved:
        return f"the gold patch does not resolve it: {gold.grading_error or gold.reason}"
    empty = grade(task, "", timeout=timeout)
    if empty.grading_error:
        return f"the buggy file could not be graded: {empty.grading_error}"
    if empty.resolved:
        return "the unedited buggy file passes"
    if lookup_passes([task]).get(task.id):
        return "a lookup of the inputs the statement shows passes the check"
    return None


def propose(
    seeds: Iterable[Seed],
    level: int,
    n: int,
    rng: random.Random,
    *,
    exclude: set[str] = frozenset(),
) -> list[Task]:
    """Up to ``n`` new (unvalidated) tasks at difficulty ``level`` from ``seeds`` (drawn by
    ``rng``), none of whose ids is in ``exclude``; tries each seed at most once per call."""
    pool = list(seeds)
    rng.shuffle(pool)
    out: list[Task] = []
    for seed in pool:
        if len(out) >= n:
            break
        task = make_task_at(seed, level, rng)
        if task is not None and task.id not in exclude:
            out.append(task)
    return out


REPAIR_SPLITS = ("all", "heldout", "outside", "train")
"""What :func:`repair_tasks` serves (``all``: every task of the file, whatever its split)."""


def repair_tasks(split: str = "all", path: str | Path = TASKS_FILE) -> list[Task]:
    """The repair tasks of ``split`` (train, heldout, outside or all) in the task file ``path``,
    interleaved by source (HumanEval and each library, :func:`coderl.tasks.repos.round_robin`),
    so a prefix (``eval.tasks``) holds every source. The shipped ``TASKS_FILE`` holds no
    ``outside`` task: those are in ``OUTSIDE_FILE``.

    Raises:
        KeyError: an unknown split. FileNotFoundError: no task file.
    """
    if split not in REPAIR_SPLITS:
        raise KeyError(f"unknown split {split!r}; valid: {list(REPAIR_SPLITS)}")
    return round_robin([t for t in load_tasks(path) if split in ("all", t.split)])


@functools.cache
def training_seeds() -> tuple[Seed, ...]:
    """Every training seed (HumanEval's training split and the training libraries' seeds): the
    only material synthesis draws from, so no held-out code reaches a training task."""
    from coderl.tasks.fnseeds import humaneval_seeds, load_seeds

    return tuple(s for s in humaneval_seeds() + load_seeds() if s.split == "train")


def synthesise(request: dict[str, Any]) -> dict[str, Any]:
    """Run one synthesis request off the trainer's critical path: propose
    ``request["n"]`` tasks at ``request["level"]`` from :func:`training_seeds` (drawn with
    ``random.Random(request["key"])``, skipping ``request["exclude"]`` ids) and validate each
    (:func:`validate`). Returns ``{"proposed": n, "tasks": [valid task JSON], "seconds": wall
    time}``: plain data, so it crosses a process boundary. The tasks are deterministic in the
    request."""
    t0 = time.perf_counter()
    rng = random.Random(request["key"])
    proposed = propose(
        training_seeds(),
        int(request["level"]),
        int(request["n"]),
        rng,
        exclude=set(request.get("exclude", ())),
    )
    valid = [t for t in proposed if validate(t) is None]
    tasks = [t.model_dump(mode="json") for t in valid]
    return {"proposed": len(proposed), "tasks": tasks, "seconds": time.perf_counter() - t0}
