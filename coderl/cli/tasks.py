"""``coderl tasks``: build-env, synth, validate, twin-check, stats, import, export, humaneval.

Examples::

    coderl tasks build-env toolz==1.0.0            # or a local path, or --from data/repos.txt
    coderl tasks synth toolz --n 40 --out data/tasks/toolz.jsonl.gz   # --append / --force
    coderl tasks validate data/tasks/toolz.jsonl.gz --out data/tasks/toolz.jsonl.gz --force
    coderl tasks twin-check data/tasks/six.jsonl.gz   # records in data/twin_check.json
    coderl tasks stats data/tasks/*.jsonl.gz
    coderl tasks import swe-gym.jsonl --format swebench --env toolz --out tasks.jsonl.gz
    coderl tasks export data/tasks/ci.jsonl --format swebench --out ci-swebench.jsonl
    coderl tasks humaneval --split heldout --out humaneval-heldout.jsonl

No action replaces an existing output file unless asked: ``synth`` adds to it with ``--append``
or replaces it with ``--force``; ``validate``, ``import``, ``export`` and ``humaneval`` replace
their ``--out`` only with ``--force``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from coderl.cli import threads_option
from coderl.rundir import enclosing_run

if TYPE_CHECKING:
    from coderl.tasks.env import EnvRecord


def _specs(args: argparse.Namespace) -> list[str]:
    specs = list(args.spec)
    if args.from_file:  # the first field of each line (data/repos.txt adds split and licence)
        for line in Path(args.from_file).read_text().splitlines():
            fields = line.split("#")[0].split()
            if fields:
                specs.append(fields[0])
    if not specs:
        raise ValueError("build-env: give at least one SPEC or --from FILE")
    return specs


def writable(path: str | Path, force: bool, append: bool | None = None) -> Path:
    """``path`` if it may be written: it does not exist, or ``force`` (or ``append``) says so.

    Raises:
        FileExistsError: ``path`` exists; names the flag that adds to it or replaces it; or it
            exists inside a training run's directory (``coderl.rundir.enclosing_run``), whose
            files no flag replaces.
    """
    out = Path(path)
    if out.exists() and not force and not append:
        how = "--append adds to it, --force replaces it" if append is not None else "--force"
        raise FileExistsError(f"{out} exists; not replaced without a flag ({how})")
    if out.exists() and (run := enclosing_run(out)) is not None:
        raise FileExistsError(
            f"{out} is inside the training run {run}: a flag never replaces a run's files there; "
            "choose a new name"
        )
    return out


def _print_failure(spec: str, error: str, step: str, attempts: list[dict[str, object]]) -> None:
    last = (error.strip().splitlines() or ["?"])[-1]
    print(f"FAILED {spec}: step {step}: {last}", flush=True)
    for a in attempts:
        print(f"  tried {a['plan']}: stopped at {a['step']}", flush=True)


def _builder(name: str) -> Callable[[str], EnvRecord]:
    from coderl.agent.buildpolicy import build_function

    try:
        return build_function(name)
    except KeyError as e:  # fail before anything is built
        raise ValueError(f"--builder: {e.args[0]}") from None


def _with_image(build: Callable[[str], EnvRecord]) -> Callable[[str], EnvRecord]:
    """``build``, then the environment's container image (``coderl.envbuild.image``)."""
    from coderl.envbuild.image import build_env_image

    def run(spec: str) -> EnvRecord:
        rec = build(spec)
        print(f"image {build_env_image(rec)} for {rec.env_id}", flush=True)
        return rec

    return run


def cmd_build_env(args: argparse.Namespace) -> int:
    from coderl.envbuild.build import BuildError

    specs = _specs(args)
    build = _builder(args.builder)
    if args.image:
        build = _with_image(build)
    if args.from_file or args.ledger:
        return _build_many(args, specs, build)
    failures = 0
    for spec in specs:
        try:
            rec = build(spec)
        except BuildError as e:  # report why, keep going with the others
            failures += 1
            _print_failure(spec, e.error, e.step, e.attempts)
            continue
        print(
            f"built {rec.env_id}: plan {rec.install_plan}, {len(rec.passing)} passing, "
            f"{len(rec.failing)} failing, {len(rec.flaky)} flaky dropped",
            flush=True,
        )
    return 1 if failures else 0


def _build_many(
    args: argparse.Namespace, specs: list[str], build: Callable[[str], EnvRecord]
) -> int:
    """``--from``/``--ledger``: resumable builds, ``--jobs`` at a time, one ledger row each."""
    import json

    from coderl.envbuild.ledger import build_many, finished, summary

    ledger = Path(args.ledger or f"{args.from_file}.ledger.jsonl")
    if args.builder == "model" and args.jobs > 1:
        raise ValueError("--builder model builds one repository at a time (one model)")

    def show(row: dict[str, object]) -> None:
        if row["status"] == "failed":
            print(f"FAILED {row['spec']}: step {row['step']}: {row['error']}", flush=True)
        else:
            print(
                f"built {row['spec']} ({row['builder']}, plan {row['plan']}) in "
                f"{row['time_s']:.0f} s: {row['passing']} passing, "
                f"{row['flaky_dropped']} flaky dropped",
                flush=True,
            )

    build_many(
        specs,
        build,
        ledger,
        jobs=args.jobs,
        retry_failed=args.retry_failed,
        log=show,
    )
    rows = list(finished(ledger).values())
    print(f"ledger {ledger}: {json.dumps(summary(rows))}")
    return 1 if any(r["status"] == "failed" and r["spec"] in specs for r in rows) else 0


def _find_env(ref: str) -> EnvRecord:
    """:func:`coderl.envbuild.build.find_env`; nothing built under that name is a user error."""
    from coderl.tasks.env import find_env

    try:
        return find_env(ref)
    except KeyError as e:
        raise ValueError(f"{e.args[0]} (build it with `coderl tasks build-env SPEC`)") from None


def cmd_synth(args: argparse.Namespace) -> int:
    from coderl.synth.repo import synthesize
    from coderl.tasks.repos import pinned, stamp
    from coderl.tasks.spec import Task, dump_tasks, load_tasks

    if args.out:
        writable(args.out, args.force, args.append)  # before looking the environment up
    env = _find_env(args.env)
    pins = pinned()  # a pinned repository's tasks carry its split and licence (data/repos.txt)
    out = writable(args.out or f"data/tasks/{env.name}.jsonl.gz", args.force, args.append)
    existing = load_tasks(out) if out.exists() and args.append else []
    known = {t.id for t in existing}
    kept = list(existing)

    def save(task: Task) -> None:  # after every kept task: an interrupted run loses nothing
        if task.id not in known:
            known.add(task.id)
            kept.append(stamp(task, pins))
            dump_tasks(kept, out)

    tasks, rejected = synthesize(
        env, args.n, seed=args.seed, max_tries=args.max_tries, log=not args.quiet, on_task=save
    )
    print(f"{len(tasks)} tasks -> {out}; rejected: {rejected}")
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from coderl.synth.validate import validate_tasks
    from coderl.tasks.spec import dump_tasks, load_tasks

    if args.out:
        writable(args.out, args.force)  # before minutes of grading, not after
    tasks = [t for path in args.files for t in load_tasks(path)]
    valid, dropped = validate_tasks(tasks, check_bug=not args.gold_only, log=not args.quiet)
    for task_id, reason in dropped.items():
        print(f"dropped {task_id}: {reason}")
    if args.out:
        dump_tasks(valid, args.out)
    print(f"{len(valid)} valid, {len(dropped)} dropped")
    errors = sum(r.startswith("grading error") for r in dropped.values())
    return 1 if errors else 0


def cmd_twin_check(args: argparse.Namespace) -> int:
    from coderl.grading import twincheck
    from coderl.grading.grade import grade
    from coderl.tasks.env import find_env
    from coderl.tasks.spec import load_tasks

    out = Path(args.out) if args.out else twincheck.TWIN_CHECK
    only = set(args.ids or [])
    tasks = [t for path in args.files for t in load_tasks(path) if t.kind == "repo"]
    tasks = [t for t in tasks if not only or t.id in only]
    errors = 0
    for n, task in enumerate(tasks, start=1):
        try:
            entry = twincheck.check_task(task, grade, env=find_env(task.env_id))
        except (KeyError, RuntimeError) as e:  # environment not built, grading error
            errors += 1
            print(f"[{n}/{len(tasks)}] {task.id}: error: {e}", flush=True)
            continue
        twincheck.save({task.id: entry}, out)  # after every task: an interrupted run loses none
        print(
            f"[{n}/{len(tasks)}] {task.id}: {len(entry['untwinned'])} untwinned of "
            f"{len(set(task.FAIL_TO_PASS))}, gold {entry['gold']}",
            flush=True,
        )
    print(f"{len(tasks) - errors} checked into {out}, {errors} errors")
    return 1 if errors else 0


def cmd_stats(args: argparse.Namespace) -> int:
    from coderl.tasks.spec import load_tasks
    from coderl.tasks.stats import task_stats

    tasks = [t for path in args.files for t in load_tasks(path)]
    stats = task_stats(tasks)
    console = Console(width=120)
    repos = Table(title=f"{stats['total']} tasks by source")
    for col in ("source", "tasks", "mean FAIL_TO_PASS", "mean PASS_TO_PASS", "licence"):
        repos.add_column(col)
    for source, row in stats["by_source"].items():
        repos.add_row(
            source,
            str(row["tasks"]),
            f"{row['mean_f2p']:.1f}",
            f"{row['mean_p2p']:.0f}",
            row["license"],
        )
    console.print(repos)
    kinds = Table(title="mutation kinds")
    kinds.add_column("mutation")
    kinds.add_column("tasks")
    for name, count in stats["by_mutation"].items():
        kinds.add_row(name, str(count))
    console.print(kinds)
    return 0


def cmd_humaneval(args: argparse.Namespace) -> int:
    from coderl.tasks.humaneval import humaneval_tasks
    from coderl.tasks.spec import dump_tasks

    out = writable(args.out, args.force)
    tasks = humaneval_tasks(args.split)
    dump_tasks(tasks, out)
    print(f"{len(tasks)} HumanEval tasks ({args.split}) -> {args.out}")
    return 0


def _format(name: str) -> tuple[Any, Any]:
    """(reader, writer) of a task format; raises ValueError naming the valid ones."""
    from coderl.tasks.swebench import FORMATS

    if name not in FORMATS:
        raise ValueError(f"unknown format {name!r}; valid: {sorted(FORMATS)}")
    reader, writer = FORMATS[name]
    return reader, writer


def _import_problems(tasks: list[Any]) -> tuple[dict[str, str], list[str]]:
    """``({task id: why it cannot be used}, [environments not built])`` of imported ``tasks``:
    an id a shipped task has with other content (the twin check record is keyed by id), a
    FAIL_TO_PASS or gold patch that cannot work (:func:`coderl.tasks.swebench.check_gold`,
    where the environment is built; instance images are not checked here)."""
    from coderl.grading.twincheck import fingerprint
    from coderl.tasks.env import find_env
    from coderl.tasks.repos import task_files
    from coderl.tasks.spec import load_tasks
    from coderl.tasks.swebench import IMAGE_PREFIX, check_gold

    shipped = {t.id: (t, path) for path in task_files() for t in load_tasks(path)}
    problems: dict[str, str] = {}
    unbuilt: set[str] = set()
    for task in tasks:
        twin = shipped.get(task.id)
        if twin is not None and fingerprint(twin[0]) != fingerprint(task):
            problems[task.id] = (
                f"the id of a shipped task ({twin[1].name}) with other content: give the "
                "instance another instance_id"
            )
        elif not task.env_id.startswith(IMAGE_PREFIX):
            try:
                snapshot = Path(find_env(task.env_id).snapshot)
            except KeyError:
                unbuilt.add(task.env_id)
                continue
            why = check_gold(task, snapshot)
            if why:
                problems[task.id] = why
    return problems, sorted(unbuilt)


def cmd_import(args: argparse.Namespace) -> int:
    """Read, check what is cheap to check (each dropped instance said in one line), write.

    Raises:
        ValueError: no instance is left to write.
    """
    from coderl.tasks.spec import dump_tasks

    reader, _ = _format(args.format)
    writable(args.out, args.force)
    env = _find_env(args.env) if args.env else None
    tasks = reader(args.file, env=env)
    problems, unbuilt = _import_problems(tasks)
    for task_id, why in problems.items():
        print(f"dropped {task_id}: {why}")
    kept = [t for t in tasks if t.id not in problems]
    if not kept:
        raise ValueError(f"{args.file}: none of its {len(tasks)} instances can be used (above)")
    dump_tasks(kept, args.out)
    print(
        f"{len(kept)} tasks ({args.format}) -> {args.out}"
        + (f", {len(problems)} dropped" if problems else "")
    )
    if unbuilt:
        print(
            f"not checked: environments {unbuilt} are not built (`coderl tasks build-env`); "
            "their gold patches and test ids are unchecked"
        )
    print(
        f"the full check (each gold patch resolves, each bug fails): coderl tasks validate {args.out}"
    )
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from coderl.tasks.spec import load_tasks

    _, writer = _format(args.format)
    writable(args.out, args.force)
    tasks = [t for path in args.files for t in load_tasks(path)]
    n = writer(tasks, args.out)
    print(f"{n} instances ({args.format}) -> {args.out}")
    return 0


BUILDER_HELP = {
    "rules": "detect the layout, then try the install plans in order (default)",
    "model": "the demo model (SmolLM2-135M) proposes the plans and writes tests where a "
    "repository has none; one repository at a time",
}
"""``--help`` text of each of ``coderl.agent.buildpolicy.BUILDERS`` (a test checks both agree)."""


def _builders() -> str:
    return "; ".join(f"{name}: {text}" for name, text in BUILDER_HELP.items())


def _force(p: argparse.ArgumentParser, help_: str = "replace an existing --out") -> None:
    p.add_argument("--force", "--overwrite", action="store_true", help=help_)


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = sub.add_parser("tasks", help="tasks from real repositories, HumanEval, grading")
    tsub = parser.add_subparsers(dest="tasks_command", metavar="ACTION", required=True)

    p = tsub.add_parser("build-env", help="build environments: NAME==VERSION or a local path")
    p.add_argument("spec", nargs="*", help="NAME==VERSION (sdist from PyPI) or a directory")
    p.add_argument("--from", dest="from_file", help="file of specs, one a line (# comments)")
    p.add_argument("--builder", default="rules", help=f"build policy: {_builders()}")
    p.add_argument("--ledger", help="JSONL ledger (default: FILE.ledger.jsonl with --from)")
    p.add_argument("--jobs", type=int, default=1, help="builds at a time (with a ledger)")
    p.add_argument("--retry-failed", action="store_true", help="rebuild specs that failed")
    p.add_argument(
        "--image",
        action="store_true",
        help="also build a container image of each environment (podman; tagged by input hash)",
    )
    threads_option(p)  # --builder model runs the model
    p.set_defaults(func=cmd_build_env)

    p = tsub.add_parser("synth", help="synthesise bug-fix tasks in a built environment")
    p.add_argument("env", help="env id, NAME==VERSION or NAME")
    p.add_argument("--n", type=int, default=20, help="tasks to keep")
    p.add_argument("--seed", type=int, default=0, help="mutation sampling seed")
    p.add_argument("--max-tries", type=int, default=None, help="stop after this many mutants")
    p.add_argument("--out", help="JSONL(.gz) file (default data/tasks/NAME.jsonl.gz)")
    p.add_argument("--append", action="store_true", help="add to the tasks already in --out")
    _force(p, "replace an existing --out (its tasks are lost)")
    p.add_argument("--quiet", action="store_true", help="no line per mutant tried")
    p.set_defaults(func=cmd_synth)

    p = tsub.add_parser("validate", help="apply each gold patch in a fresh sandbox; drop invalid")
    p.add_argument("files", nargs="+", help="coderl task JSONL(.gz) files")
    p.add_argument("--out", help="write the valid tasks here")
    _force(p)
    p.add_argument("--gold-only", action="store_true", help="skip the starting-state check")
    p.add_argument("--quiet", action="store_true", help="no line per task")
    p.set_defaults(func=cmd_validate)

    p = tsub.add_parser(
        "twin-check", help="grade each gold patch with twins; record tests whose twins break it"
    )
    p.add_argument("files", nargs="+", help="coderl task JSONL(.gz) files")
    p.add_argument("--ids", nargs="*", help="only these task ids")
    p.add_argument("--out", help="the record to update (default data/twin_check.json)")
    p.set_defaults(func=cmd_twin_check)

    p = tsub.add_parser("stats", help="per-repo counts and mutation kinds")
    p.add_argument("files", nargs="+", help="coderl task JSONL(.gz) files")
    p.set_defaults(func=cmd_stats)

    p = tsub.add_parser("import", help="read tasks in another format (SWE-bench instances)")
    p.add_argument("file", help="JSONL(.gz) or JSON array of instances")
    p.add_argument(
        "--format",
        default="swebench",
        help="default swebench; an unknown name lists the valid ones",
    )
    p.add_argument("--env", help="environment of every instance (env id, NAME==VERSION, NAME)")
    p.add_argument("--out", required=True, help="coderl task JSONL(.gz)")
    _force(p)
    p.set_defaults(func=cmd_import)

    p = tsub.add_parser("export", help="write coderl tasks in another format (SWE-bench)")
    p.add_argument("files", nargs="+", help="coderl task JSONL(.gz) files")
    p.add_argument(
        "--format",
        default="swebench",
        help="default swebench; an unknown name lists the valid ones",
    )
    p.add_argument("--out", required=True, help=".json (array) or .jsonl(.gz)")
    _force(p)
    p.set_defaults(func=cmd_export)

    p = tsub.add_parser("humaneval", help="write HumanEval function tasks (train or heldout)")
    p.add_argument("--split", choices=["train", "heldout", "all"], default="train",
                   help="which tasks of coderl's one fixed HumanEval split")  # fmt: skip
    p.add_argument("--out", required=True, help="coderl task JSONL(.gz)")
    _force(p)
    p.set_defaults(func=cmd_humaneval)
