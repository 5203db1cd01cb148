"""Synchronous vs asynchronous RL on a latency-dominated toy task, measured in the same run.

Both arms train the same toy bandit (:mod:`coderl.asyncrl.toy`) on the same task stream for the
same number of optimizer steps (the same episode budget), with the same rollout workers. The
synchronous arm is the async loop at ``max_staleness=0``, which the test suite proves identical to
the synchronous loop; it still runs its workers in parallel, so the ratio measures asynchrony only.

Environment latency per group is log-normal with mean ``--delay`` seconds and tail ``--sigma``
(some tasks are slow: long test suites, long episodes); ``--train-delay`` stands in for the
optimizer step. Prints trajectories/s, optimizer steps/hour, trainer and rollout idle fractions,
dropped groups, and the final exact expected reward (mean +- std over ``--seeds``), plus the
async/sync throughput ratio. Published anchors: AReaL 2.77x, verl 2.35-2.67x.

    .venv/bin/python bench/async.py              # the README numbers (~2 min on 2 busy cores)
    .venv/bin/python bench/async.py --quick      # a smoke run (~15 s)
"""

from __future__ import annotations

import argparse
import functools
import statistics

from rich.console import Console
from rich.table import Table

from coderl.asyncrl import AsyncConfig, AsyncRunner, cycle_tasks
from coderl.asyncrl.toy import ToyLearner, ToySampler, toy_tasks


def run_arm(args: argparse.Namespace, max_staleness: int, seed: int) -> dict[str, float]:
    """One training run; returns its summary plus the final expected reward."""
    tasks = cycle_tasks(toy_tasks(args.tasks, args.vocab))
    sampler = functools.partial(
        ToySampler,
        args.tasks,
        args.vocab,
        group_size=args.group_size,
        turns=args.turns,
        delay_s=args.delay,
        delay_sigma=args.sigma,
    )
    learner = ToyLearner(args.tasks, args.vocab, lr=args.lr, train_delay_s=args.train_delay)
    cfg = AsyncConfig(
        num_workers=args.workers,
        groups_per_step=args.groups,
        max_staleness=max_staleness,
        stale_policy=args.stale_policy,
        poll_s=0.01,
    )
    with AsyncRunner(cfg, learner, sampler, tasks, seed=seed) as runner:
        summary = runner.run(args.steps)
    summary["final_reward"] = learner.expected_reward()
    return summary


def mean_std(xs: list[float]) -> str:
    return f"{statistics.mean(xs):.3f} +- {statistics.stdev(xs) if len(xs) > 1 else 0.0:.3f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--delay", type=float, default=0.2, help="mean environment latency per group (s)"
    )
    p.add_argument("--sigma", type=float, default=1.0, help="log-normal tail of the latency")
    p.add_argument("--train-delay", type=float, default=0.05, help="seconds per optimizer step")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--groups", type=int, default=8, help="groups per optimizer step")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--turns", type=int, default=2)
    p.add_argument("--tasks", type=int, default=16)
    p.add_argument("--vocab", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--staleness", type=int, nargs="+", default=[1, 2])
    p.add_argument("--stale-policy", default="drop", choices=["drop", "resample"])
    p.add_argument("--quick", action="store_true", help="a short smoke run")
    args = p.parse_args()
    if args.quick:
        args.steps, args.seeds, args.delay = 8, 1, 0.1
    arms = {0: "sync (max_staleness=0)"} | {s: f"async (max_staleness={s})" for s in args.staleness}
    results: dict[int, list[dict[str, float]]] = {s: [] for s in arms}
    for seed in range(args.seeds):
        for s in arms:
            results[s].append(run_arm(args, s, seed))

    table = Table(
        title=(
            f"{args.steps} steps x {args.groups} groups x {args.group_size} episodes, "
            f"{args.workers} workers, latency mean {args.delay}s sigma {args.sigma}, "
            f"train step {args.train_delay}s, {args.seeds} seeds"
        )
    )
    for col in (
        "arm",
        "traj/s",
        "x sync",
        "steps/hour",
        "trainer idle",
        "rollout idle",
        "dropped",
        "mean staleness",
        "final reward",
    ):
        table.add_column(col)
    base = statistics.mean(r["trajectories_per_s"] for r in results[0])
    for s, name in arms.items():
        rs = results[s]
        tps = statistics.mean(r["trajectories_per_s"] for r in rs)
        table.add_row(
            name,
            f"{tps:.1f}",
            f"{tps / base:.2f}",
            f"{statistics.mean(r['optimizer_steps_per_hour'] for r in rs):.0f}",
            f"{statistics.mean(r['trainer_idle_fraction'] for r in rs):.2f}",
            f"{statistics.mean(r['rollout_idle_fraction'] for r in rs):.2f}",
            f"{statistics.mean(r['dropped_groups'] for r in rs):.1f}",
            f"{statistics.mean(r['mean_staleness'] for r in rs):.2f}",
            mean_std([r["final_reward"] for r in rs]),
        )
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
