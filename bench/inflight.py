"""In-flight weight updates on ``coderl train-async`` with long episodes, off vs on, same run.

Every arm is a real ``train_async`` run (tiny random model, full fine-tuning, the in-process toy
task of ``configs/toy.yaml``) with long completions (``--max-new-tokens``, default 192 sampled
tokens per episode); arms differ only in ``async.max_staleness`` and ``async.inflight``. With
in-flight updates a worker loads the newest weights every ``--chunk`` decode steps and the torch
engine recomputes the KV cache of the running rows under them (a prefill of each row's context).

Prints per arm (mean over ``--repeats``, arms interleaved so they share the machine's load):
wall seconds, trainer idle fraction (time the trainer waited for an admissible batch), rollout
idle fraction, group staleness (``version - oldest token``, what admission bounds), token
staleness mean and max (``version - token's version``), dropped groups, the sampler/trainer
logprob gap, and the last step's mean reward; then the CPU, its flags and the load.

``--varied`` gives tasks episode lengths of 1/4 to 4/4 of ``--max-new-tokens`` (task ``i``:
``(1 + i % 4) / 4``), so rollouts end at different times instead of in lockstep.

    PYTHONPATH=. .venv/bin/python bench/inflight.py --repeats 3 --steps 10   # the docs' figures
    PYTHONPATH=. .venv/bin/python bench/inflight.py --repeats 3 --steps 10 --varied
    PYTHONPATH=. .venv/bin/python bench/inflight.py --quick                  # a smoke run (~15 s)

(each full run ~3 min on the 2 shared cores; ``PYTHONPATH=.`` makes a worktree's ``coderl`` the
one imported).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).parent))

from grading import cpu_flags  # noqa: E402

from coderl.asyncrl.trainer import train_async  # noqa: E402
from coderl.config import load_config  # noqa: E402
from coderl.envs import ENVIRONMENTS, ToyEnvironment  # noqa: E402
from coderl.metrics import read_jsonl  # noqa: E402

TOY = Path(__file__).parent.parent / "configs" / "toy.yaml"


@dataclass
class VariedToy(ToyEnvironment):
    """The toy task with episode lengths that vary by task: task ``i`` samples
    ``max_new_tokens * (1 + i % 4) / 4`` tokens (a rollout takes its first task's), so rollouts
    end at different times, as agent episodes do, instead of in lockstep."""

    def rollout(self, policy, tasks, params, group_size):  # type: ignore[no-untyped-def]
        i = int(tasks[0].id.rsplit("/", 1)[1])
        n = max(1, self.max_new_tokens * (1 + i % 4) // 4)
        return super().rollout(policy, tasks, replace(params, max_new_tokens=n), group_size)


ENVIRONMENTS["toy-varied"] = lambda cfg: VariedToy(max_new_tokens=cfg.rollout.max_new_tokens)


def run_arm(args: argparse.Namespace, staleness: int, inflight: bool, seed: int) -> dict:
    """One ``train_async`` run; its summary plus the run's mean logprob gap and last reward."""
    with tempfile.TemporaryDirectory(prefix="inflight-") as run_dir:
        cfg = load_config(
            TOY,
            [
                f"run_dir={run_dir}",
                f"seed={seed}",
                f"trainer.steps={args.steps}",
                f"trainer.checkpoint_every={args.steps}",
                f"rollout.max_new_tokens={args.max_new_tokens}",
                f"rollout.group_size={args.group_size}",
                "trainer.micro_batch_size=16",
                "tensorboard=false",
                "progress=false",
                "eval.before_after=false",
                f"async.max_staleness={staleness}",
                f"async.num_workers={args.workers}",
                f"async.tasks_per_rollout={args.tasks_per_rollout}",
                f"async.inflight.enabled={str(inflight).lower()}",
                f"async.inflight.chunk_tokens={args.chunk}",
                f"tasks.source={'toy-varied' if args.varied else 'toy'}",
            ],
        )
        summary = train_async(cfg)
        rows = [r for r in read_jsonl(Path(run_dir) / "metrics.jsonl") if "loss" in r]
    summary["gap"] = statistics.mean(r["logprob_gap"] for r in rows)
    summary["reward"] = rows[-1]["reward/mean"]
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=192, help="sampled tokens per episode")
    p.add_argument("--chunk", type=int, default=32, help="async.inflight.chunk_tokens")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument(
        "--tasks-per-rollout", type=int, default=2, help="1: each worker rolls out one group"
    )
    p.add_argument("--staleness", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument(
        "--varied", action="store_true", help="episode lengths vary by task (1/4 to 4/4)"
    )
    p.add_argument("--quick", action="store_true", help="a short smoke run")
    args = p.parse_args()
    if args.quick:
        args.steps, args.repeats, args.max_new_tokens, args.staleness = 3, 1, 64, [1]
    torch.set_num_threads(1)  # a tiny model gains nothing from intra-op threads
    started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    load_before = os.getloadavg()[0]
    arms = [(s, f) for s in args.staleness for f in (False, True)]
    results: dict[tuple[int, bool], list[dict]] = {a: [] for a in arms}
    for rep in range(args.repeats):
        for s, f in arms:
            results[(s, f)].append(run_arm(args, s, f, seed=rep))

    table = Table(
        title=(
            f"train-async, tiny model, toy task: {args.steps} steps x 2 tasks x G={args.group_size}, "
            f"{args.max_new_tokens} tokens/episode{' (1/4 to 4/4 by task)' if args.varied else ''}, "
            f"{args.workers} thread workers, "
            f"{args.tasks_per_rollout} task(s) per rollout, "
            f"chunk {args.chunk}, {args.repeats} repeats"
        )
    )
    cols = ["arm", "wall s", "trainer idle", "rollout idle", "group stale", "token stale"]
    for col in [*cols, "token stale max", "dropped", "logprob gap", "reward"]:
        table.add_column(col)

    def mean(rs: list[dict], key: str) -> float:
        return statistics.mean(float(r[key]) for r in rs)

    for s, f in arms:
        rs = results[(s, f)]
        table.add_row(
            f"max_staleness={s}, inflight {'on' if f else 'off'}",
            f"{mean(rs, 'wall_s'):.1f}",
            f"{mean(rs, 'trainer_idle_fraction'):.2f}",
            f"{mean(rs, 'rollout_idle_fraction'):.2f}",
            f"{mean(rs, 'mean_staleness'):.2f}",
            f"{mean(rs, 'token_staleness_mean'):.2f}",
            f"{max(r['token_staleness_max'] for r in rs)}",
            f"{mean(rs, 'dropped_groups'):.1f}",
            f"{mean(rs, 'gap'):.4f}",
            f"{mean(rs, 'reward'):.3f}",
        )
    Console(width=200).print(table)
    print(f"started {started}; CPU: {cpu_flags()}; torch threads 1")
    print(f"load average (1 min) at start {load_before:.1f}, at end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
