"""Build the shipped function-repair files: ``python -m coderl.synth.fnrepair_build``.

    python -m coderl.synth.fnrepair_build seeds --sdists DIR     # library seeds (traced tests)
    python -m coderl.synth.fnrepair_build tasks --levels 0,1,2   # validated repair tasks
    python -m coderl.synth.fnrepair_build outside --sdists DIR   # the kept-back set, both steps

``seeds`` unpacks the pinned sdists of ``fnseeds.LIBRARIES`` found in ``DIR`` (``pip download
--no-binary :all: --no-deps NAME==VERSION -d DIR``) and writes ``data/fnrepair/seeds.jsonl.gz``.
``tasks`` makes one task per seed and level (HumanEval and library seeds), validates each in fresh
sandboxes (:func:`coderl.synth.fnrepair.validate`) and writes the valid ones to
``data/fnrepair/tasks.jsonl.gz``. ``outside`` does both for the kept-back libraries
(``fnseeds.OUTSIDE_LIBRARIES``, pinned in ``data/fnrepair/outside.txt``): their seeds go to
``data/fnrepair/outside-seeds.jsonl.gz``, their tasks (split ``outside``) to
``data/fnrepair/outside.jsonl.gz``; without ``--sdists`` it remakes the tasks from the shipped
seeds. The random draws are seeded per (seed, level): the same seeds give the same file.
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import sys
import tempfile
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from coderl.synth.fnrepair import OUTSIDE_FILE, TASKS_FILE, make_task_at, validate
from coderl.tasks.fnseeds import (
    LIBRARIES,
    OUTSIDE_LIBRARIES,
    OUTSIDE_SEEDS_FILE,
    SEEDS_FILE,
    Seed,
    dump_seeds,
    humaneval_seeds,
    library_pin,
    library_seeds,
    load_seeds,
    unpack_sdist,
)
from coderl.tasks.spec import Task, dump_tasks


def build_seeds(sdists: Path, out: Path, names: tuple[str, ...] = tuple(LIBRARIES)) -> list[Seed]:
    """Library seeds of the libraries ``names`` (default every ``LIBRARIES`` entry), each from its
    pinned sdist in ``sdists`` (:func:`coderl.tasks.fnseeds.library_pin`).

    Raises:
        FileNotFoundError: a pinned sdist is missing (names the download command).
    """
    seeds: list[Seed] = []
    with tempfile.TemporaryDirectory(prefix="coderl-sdists-") as tmp:
        for name in names:
            pin = library_pin(name)[0]
            stem = f"{pin.name.replace('-', '_')}-{pin.version}"
            found = sorted(sdists.glob(f"{stem}.tar.gz")) + sorted(sdists.glob(f"{stem}.zip"))
            if not found:
                raise FileNotFoundError(
                    f"no sdist of {pin.spec} in {sdists}: pip download --no-binary :all: "
                    f"--no-deps {pin.spec} -d {sdists}"
                )
            dest = Path(tmp) / name
            dest.mkdir()
            made = library_seeds(name, unpack_sdist(found[0], dest))
            print(f"{name}: {len(made)} seeds", file=sys.stderr)
            seeds += made
    dump_seeds(seeds, out)
    return seeds


def _one(job: tuple[Seed, int]) -> Task | None:
    seed, level = job
    rng = random.Random(f"{seed.id}/{level}")
    task = make_task_at(seed, level, rng)
    return task if task is not None and validate(task) is None else None


def build_tasks(seeds: list[Seed], levels: list[int], out: Path, workers: int = 2) -> list[Task]:
    """One validated task per (seed, level) where one can be made; written to ``out`` in a
    seeded random order. Worker
    processes, not threads: CPython 3.11's ``ast`` is not safe to use from several threads at
    once (a ``SystemError`` on recursion depth)."""
    jobs = [(s, lv) for s in seeds for lv in levels]
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        made = list(pool.map(_one, jobs, chunksize=4))
    unique = list({t.id: t for t in made if t is not None}.values())
    random.Random(0).shuffle(unique)  # a prefix (eval.tasks) mixes seeds and levels
    dump_tasks(unique, out)
    return unique


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m coderl.synth.fnrepair_build")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("seeds", help="library seeds from traced sdist tests")
    s.add_argument("--sdists", type=Path, required=True)
    s.add_argument("--out", type=Path, default=SEEDS_FILE)
    t = sub.add_parser("tasks", help="validated repair tasks from every seed")
    t.add_argument("--levels", default="0,1,2")
    t.add_argument("--humaneval", type=int, default=164, help="first N HumanEval problems")
    t.add_argument("--out", type=Path, default=TASKS_FILE)
    o = sub.add_parser("outside", help="the kept-back set: seeds and tasks of OUTSIDE_LIBRARIES")
    o.add_argument("--sdists", type=Path, help="trace the sdists here (else: the shipped seeds)")
    o.add_argument("--levels", default="0,1,2,3")
    o.add_argument("--seeds-out", type=Path, default=OUTSIDE_SEEDS_FILE)
    o.add_argument("--out", type=Path, default=OUTSIDE_FILE)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "seeds":
            build_seeds(args.sdists, args.out)
            return 0
        if args.cmd == "outside" and args.sdists is not None:
            build_seeds(args.sdists, args.seeds_out, tuple(OUTSIDE_LIBRARIES))
    except FileNotFoundError as e:
        print(f"fnrepair_build: {e}", file=sys.stderr)
        return 2
    if args.cmd == "outside":
        seeds = load_seeds(args.seeds_out)
    else:
        seeds = humaneval_seeds()[: args.humaneval] + load_seeds()
    tasks = build_tasks(seeds, [int(x) for x in args.levels.split(",")], args.out)
    by_split = Counter(t.split for t in tasks)
    by_source = Counter(t.source for t in tasks)
    print(
        f"{len(tasks)} tasks ({dict(by_split)}; {dict(by_source)}) -> {args.out}", file=sys.stderr
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
