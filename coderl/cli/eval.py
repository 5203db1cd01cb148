"""``coderl eval CHECKPOINT [tasks=SOURCE:SPLIT] [k=16] [key=value ...]``: pass@1, pass@k and
best-of-n with 95% CIs for a training checkpoint (its run's ``config.yaml`` says which model,
adapter shape and environment). On repository tasks it also reports, per repository, the resolved
rate and the fraction of FAIL_TO_PASS tests passed with 95% CIs (``per_repo`` in the JSON, and a
table on stderr). ``--episodes-out FILE`` also writes every evaluated episode
(task statement, diff, tool log, test outcomes, resolved) as the episodes JSONL that
``coderl rm train --episodes`` and ``coderl graders probe`` read (an existing FILE is replaced
only with ``--force``). ``--harness DIR`` writes the repository tasks' first episodes as a
SWE-bench harness run (``coderl.grading.harness``: predictions, per-instance reports with
``resolved`` and ``tests_status``, the summary of ``swebench``'s ``make_run_report``), so that a
run's number can be set beside published ones. An online run's directory gives its champion
(``--version N``: any registry version; ``--base``: the base model), read with the config its
registry recorded (:mod:`coderl.online.runfiles`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from coderl.cli.export import add_source, is_online
from coderl.cli.tasks import writable
from coderl.config import load_config
from coderl.metrics import reported
from coderl.online.runfiles import OnlineRun, describe, open_online_run, pick_version


def _split_args(items: list[str]) -> tuple[str | None, int | None, list[str]]:
    """(``tasks=`` value, ``k=`` value, the other overrides).

    Raises:
        ValueError: ``k`` is not a positive integer.
    """
    tasks, k, rest = None, None, []
    for item in items:
        key, _, value = item.partition("=")
        if key == "tasks":
            tasks = value
        elif key == "k":
            if not value.strip().isdigit() or int(value) < 1:
                raise ValueError(f"k={value}: k must be a positive integer (samples per task)")
            k = int(value)
        else:
            rest.append(item)
    return tasks, k, rest


def _check_split(cfg: Any, tasks: str | None, split: str) -> None:
    """Fail before the model loads when the ``tasks=SOURCE:SPLIT`` split has no tasks.

    Raises:
        ValueError: unknown split (the environment's message lists the valid ones), empty, or
            some of its evaluated tasks' environments are not built.
    """
    from coderl.envs.registry import build_environment, check_built

    env = build_environment(cfg)
    try:
        found = env.tasks(split)
    except KeyError as e:
        raise ValueError(f"tasks={tasks or split}: {e.args[0]}") from None
    if not found:
        raise ValueError(f"tasks={tasks or split}: split {split!r} has no tasks")
    check_built(env, split, cfg.eval.tasks)


def _online(args: argparse.Namespace) -> tuple[OnlineRun | None, int | None]:
    """The online run ``args.checkpoint`` names and the registry version to evaluate (``--version``,
    else the champion; None with ``--base``), or ``(None, None)`` for a training run.

    Raises:
        ValueError: ``--version`` for a training run (:func:`coderl.cli.export.is_online`).
        FileNotFoundError: no promoted champion yet, an unknown version
            (:func:`coderl.online.runfiles.pick_version`).
    """
    if not is_online(args.checkpoint, args.version):
        return None, None
    online = open_online_run(args.checkpoint)
    if args.base:
        return online, None
    version, _ = pick_version(online, args.version)
    print(f"evaluating {describe(online, version)}", file=sys.stderr, flush=True)
    return online, version


def run(args: argparse.Namespace) -> int:
    from coderl.eval.passk import per_task_pass
    from coderl.policy.rollout import build_engine
    from coderl.policy.threads import use_threads
    from coderl.train.checkpoint import load_checkpoint, resolve_checkpoint
    from coderl.train.run import close_run, run_eval, setup_run

    if args.episodes_out:  # before the model loads
        writable(args.episodes_out, args.force)
    if args.harness:
        writable(args.harness, args.force)
    online, version = _online(args)  # an online run: its champion or --version N
    if online is not None:
        run_dir, config = online.run_dir, online.config
        ckpt = online.registry.version_dir(version) if version is not None else online.run_dir
    else:
        run_dir, ckpt = resolve_checkpoint(args.checkpoint)  # a run directory: its newest one
        config = run_dir / "config.yaml"
    tasks, k, rest = _split_args(args.overrides)
    # the run as found on disk, not as its config.yaml names it (a relative run_dir names
    # another directory, or none, from anywhere but where the run was started)
    overrides = [*rest, "eval.before_after=false", f"run_dir={run_dir}"]
    split = None
    if tasks:
        source, _, split = tasks.partition(":")
        overrides.append(f"tasks.source={source}")
    if k:
        overrides += [f"eval.samples={k}", f"eval.k={sorted({1, k})}"]
    cfg = load_config(config, overrides)
    use_threads(cfg.threads)
    _check_split(cfg, tasks, split or cfg.tasks.heldout_split)
    # --base: the model of model.name; no data cursor (a task file may hold only held-out tasks)
    run_ = setup_run(cfg, engine=False, load_sft=False, training=False)
    if online is not None and version is not None:
        from coderl.online.cycle import load_version_into

        load_version_into(run_.policy.model, cfg, online.registry, version)
    elif not args.base:
        load_checkpoint(ckpt, model=run_.policy.model, restore_rng=False)
    run_.engine = build_engine(cfg, run_.policy, training=False)  # engine.kind, these weights
    episodes: list[tuple[Any, bool]] | None = [] if args.episodes_out or args.harness else None
    if args.harness and not any(
        getattr(t, "kind", None) == "repo"
        for t in run_.env.tasks(split or cfg.tasks.heldout_split)[: cfg.eval.tasks]
    ):
        close_run(run_)
        raise ValueError(
            f"--harness: tasks.source={cfg.tasks.source!r} has no repository tasks to report in "
            "SWE-bench's format (repo, swebench or an instance file)"
        )
    try:
        result = run_eval(run_, split or None, episodes)
        evaluated = run_.env.tasks(split or cfg.tasks.heldout_split)[: cfg.eval.tasks]
        if args.harness:  # in the run's sandbox backend, set until close_run
            from coderl.grading.harness import eval_rows, write_run

            rows = eval_rows(evaluated, episodes or [])
            summary = write_run(Path(args.harness), ckpt.name, cfg.model.name, rows)
            print(f"harness run: {summary} ({len(rows)} predictions)", file=sys.stderr)
    finally:
        close_run(run_)
    if args.episodes_out and episodes is not None:
        from coderl.graders.pairs import write_episodes

        write_episodes(args.episodes_out, [v for v, _ in episodes], [ok for _, ok in episodes])
    out = {  # --base loads no checkpoint: the record names the base model, not one
        "checkpoint": None if args.base else str(ckpt),
        **({"registry_version": version} if version is not None else {}),
        "base": args.base,
        **({"model": cfg.model.name} if args.base else {}),
        "split": split or cfg.tasks.heldout_split,
    }
    out.update({k_: v for k_, v in result.items() if k_ != "per_task"})
    ks = sorted(int(k_) for k_ in result["pass_at"])
    out["per_task"] = per_task_pass(result["per_task"], ks)  # after the totals: easy to read
    if any(getattr(t, "kind", None) == "repo" for t in evaluated):
        from coderl.tasks.repos import per_repo_report, print_per_repo

        out["per_repo"] = per_repo_report(result["per_task"], evaluated)
        print_per_repo(out["per_repo"])  # a table on stderr; stdout stays one JSON document
    print(json.dumps(reported(out), indent=1))
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("eval", help="pass@k and best-of-n of a checkpoint on a task split")
    add_source(p, "checkpoint", "a checkpoint directory, a run directory (its latest)")
    p.add_argument(
        "overrides",
        nargs="*",
        help="tasks=SOURCE:SPLIT; k=N (pass@1 and pass@N; also sets N samples per task, overriding "
        "eval.samples); eval.tasks=N (N held-out tasks, not the whole split); or any key=value",
    )
    p.add_argument("--base", action="store_true", help="evaluate the base model (no adapter)")
    p.add_argument(
        "--episodes-out",
        metavar="FILE",
        help="also write the evaluated episodes as JSONL (for `coderl rm train --episodes` "
        "and `coderl graders probe`)",
    )
    p.add_argument(
        "--harness",
        metavar="DIR",
        help="also write a SWE-bench harness run of the repository tasks to DIR: "
        "predictions.jsonl, logs/run_evaluation/.../report.json and swebench's summary",
    )
    p.add_argument(
        "--force", action="store_true", help="replace an existing --episodes-out or --harness"
    )
    p.set_defaults(func=run)
