"""Build the shipped function-repair files: ``python -m coderl.synth.fnrepair_build``.

    python -m coderl.synth.fnrepair_build seeds --sdists DIR     # library seeds (traced tests)
    python -m coderl.synth.fnrepair_build tasks --levels 0,1,2   # validated repair tasks

``seeds`` unpacks the pinned sdists of ``fnseeds.LIBRARIES`` found in ``DIR`` (``pip download
--no-binary :all: --no-deps NAME==VERSION -d DIR``) and writes ``data/fnrepair/seeds.jsonl.gz``.
``tasks`` makes one task per seed and level (HumanEval and library seeds), validates each in fresh
sandboxes (:func:`coderl.synth.fnrepair.validate`) and writes the valid ones to
``data/fnrepair/tasks.jsonl.gz``. The random draws are seeded per (seed, level): the same seeds give
the same file.
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from coderl.synth.fnrepair import TASKS_FILE, make_task_at, validate
from coderl.tasks.fnseeds import (
    LIBRARIES,
    SEEDS_FILE,
    Seed,
    dump_seeds,
    humaneval_seeds,
    library_seeds,
    load_seeds,
    unpack_sdist,
)
from coderl.tasks.repos import pinned
from coderl.tasks.spec import Task, dump_tasks


def build_seeds(sdists: Path, out: Path) -> list[Seed]:
    """Library seeds of every ``LIBRARIES`` entry whose pinned sdist is in ``sdists``.

    Raises:
        FileNotFoundError: a pinned sdist is missing (names the download command).
    """
    pins = pinned()
    seeds: list[Seed] = []
    with tempfile.TemporaryDirectory(prefix="coderl-sdists-") as tmp:
        for name in LIBRARIES:
            pin = pins[name]
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
    args = ap.parse_args(argv)
    if args.cmd == "seeds":
        try:
            build_seeds(args.sdists, args.out)
        except FileNotFoundError as e:
            print(f"fnrepair_build: {e}", file=sys.stderr)
            return 2
        return 0
    seeds = humaneval_seeds()[: args.humaneval] + load_seeds()
    tasks = build_tasks(seeds, [int(x) for x in args.levels.split(",")], args.out)
    by = {sp: sum(t.split == sp for t in tasks) for sp in ("train", "heldout")}
    print(f"{len(tasks)} tasks ({by}) -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
