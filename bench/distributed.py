"""The sharded trainer step (FSDP2, gloo, CPU) on two ranks against one rank, in one run.

Both sides run :func:`coderl.train.distributed.sharded_train_step` on the same global batch
(tiny-random, full fine-tuning, ``--rows`` rows of 24-40 tokens, micro-batches of 4 rows, one
torch thread per rank); the one-rank side is a world of size 1 (the same code, no peer). The
first ``--warmup`` steps are not timed; the median of the others is printed for both, with the
ratio, the CPU's torch capability and the load average. On a 2-core machine two ranks share
the cores with everything else: expect them slower; the point of the sharded trainer is memory
and machines beyond one, and its test is correctness (tests/test_distributed.py).

    PYTHONPATH=. .venv/bin/python bench/distributed.py
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    import torch.distributed as dist

    from coderl.config import AlgorithmConfig, DistributedConfig, TrainerConfig
    from coderl.policy.loading import load_policy
    from coderl.train.batch import build_batch
    from coderl.train.distributed import init_distributed, shard_policy, sharded_train_step
    from coderl.train.optim import build_optimizer
    from coderl.trajectory import Segment

    w = init_distributed(DistributedConfig(enabled=True), torch.device("cpu"))
    torch.manual_seed(0)
    policy = load_policy("tiny-random", reference=False)
    g = torch.Generator().manual_seed(1)
    segs = []
    for i in range(args.rows):
        ids = torch.randint(3, 100, (24 + i % 17,), generator=g).tolist()
        seg = Segment()
        seg.append_context(ids[:8])
        seg.append_sampled(ids[8:], [-1.0] * (len(ids) - 8), 0)
        segs.append(seg)
    batch = build_batch(segs, torch.randn(args.rows, generator=g).tolist(), policy.pad_token_id)
    root = shard_policy(policy.model, None, w.mesh)
    trainer = TrainerConfig(lr=1e-4, micro_batch_size=4)
    opt, sched = build_optimizer([{"params": policy.trainable_parameters()}], trainer)
    alg = AlgorithmConfig(old_logp="behaviour")
    times = []
    for _ in range(args.warmup + args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        sharded_train_step(root, opt, sched, batch, alg, trainer, temperature=1.0, max_len=40)
        times.append(time.perf_counter() - t0)
    if rank == 0:
        Path(out).write_text(json.dumps(times[args.warmup :]))
    dist.destroy_process_group()


def _side(world: int, args: argparse.Namespace) -> float:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tempfile.mktemp(suffix=".json")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, world, port, args, out)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        sys.exit(f"a rank of the {world}-rank side failed")
    return statistics.median(json.loads(Path(out).read_text()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    one, two = _side(1, args), _side(2, args)
    print(f"date {time.strftime('%Y-%m-%d %H:%M:%S %Z')}")
    print(f"cpu capability {torch.backends.cpu.get_cpu_capability()}, cores {os.cpu_count()}")
    print(f"load average (1, 5, 15 min) {os.getloadavg()}")
    print(f"global batch {args.rows} rows, median of {args.steps} steps after {args.warmup}")
    print(f"one rank  {one:.3f} s/step")
    print(f"two ranks {two:.3f} s/step")
    print(f"ratio two/one {two / one:.2f}")


if __name__ == "__main__":
    main()
