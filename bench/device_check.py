"""The prepared device check: load, sample, train, sync, canary, on ``--device`` (default
``auto``: the GPU when torch sees one) through ``--engine`` (``torch``, or ``vllm`` when a vLLM
interpreter is available: ``.venv-vllm`` or ``$CODERL_VLLM_PYTHON``). Not a test: run it on a
machine with an accelerator and keep its output with the date.

It trains ``--steps`` steps of the toy task (``configs/toy.yaml``, LoRA) through ``coderl train``'s
own functions, then checks that every parameter, optimizer state tensor and the step's batch live
on the configured device, and prints per-step timings, the canary gap (vLLM) and where each
tensor lives. Exits non-zero when a tensor is elsewhere.

``--sharded N``: the same check of the sharded trainer (``trainer.distributed.enabled``, split
rollouts), a 2-step run under ``torchrun``: on CUDA one rank per GPU, ``min(N, GPUs)`` ranks
(one GPU: world size 1) over NCCL; on CPU N ranks over gloo. Each rank checks its own shards
(the local tensor of every DTensor), then writes a DCP checkpoint and runs a split held-out
evaluation; rank 0 prints what it ran on (backend, world size, devices).

    .venv/bin/python bench/device_check.py                      # auto device, torch engine
    .venv/bin/python bench/device_check.py --engine vllm --model smollm2-135m --steps 2
    .venv/bin/python bench/device_check.py --sharded 2          # torchrun; gloo on CPU
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from coderl.config import load_config
from coderl.train import loop
from coderl.train.run import close_run, resolve_device, run_eval, save, setup_run

TOY = Path(__file__).resolve().parents[1] / "configs" / "toy.yaml"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--engine", default="torch", choices=["torch", "vllm"])
    ap.add_argument("--model", default="tiny-random")
    ap.add_argument("--steps", type=int, default=None, help="default: 3 (2 with --sharded)")
    ap.add_argument("--sharded", type=int, default=0, metavar="N", help="ranks (see above)")
    ap.add_argument("--run-dir", default=None, help="default: a new temporary directory")
    args = ap.parse_args()
    if args.sharded and "WORLD_SIZE" not in os.environ:
        return launch(args)
    overrides = [
        "progress=false", "tensorboard=false", "eval.before_after=false",
        f"model.name={args.model}", "model.lora=true", "model.lora_r=8", "trainer.lr=0.05",
        f"trainer.device={args.device}", f"engine.kind={args.engine}",
        "engine.max_model_len=1024", "algorithm.kl.coef=0.1",
    ]  # fmt: skip
    if args.sharded:  # a rank under torchrun
        overrides += ["trainer.distributed.enabled=true", "eval.tasks=4", "eval.batch_episodes=8"]
    run_dir = args.run_dir or tempfile.mkdtemp(prefix="coderl-device-")
    cfg = load_config(TOY, [f"run_dir={run_dir}", *overrides])
    return check(cfg, args.steps or (2 if args.sharded else 3))


def launch(args: argparse.Namespace) -> int:
    """Start ``--sharded`` ranks of this script under ``torchrun`` (one per GPU on CUDA, at
    most as many as there are GPUs) and return its exit status."""
    device = resolve_device(args.device)
    ranks = min(args.sharded, torch.cuda.device_count()) if device.type == "cuda" else args.sharded
    backend = "nccl" if device.type == "cuda" else "gloo"
    say(f"sharded check: {ranks} rank(s) on {device.type} over {backend} (asked {args.sharded})")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", __file__,
        f"--sharded={ranks}", f"--device={args.device}", f"--engine={args.engine}",
        f"--model={args.model}", f"--steps={args.steps or 2}",
        f"--run-dir={args.run_dir or tempfile.mkdtemp(prefix='coderl-device-sharded-')}",
    ]  # fmt: skip
    return subprocess.run(cmd, check=False).returncode


def say(line: str) -> None:
    """Print ``line`` in one write, flushed (the ranks share one stdout: lines stay whole)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what this rank holds), else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def check(cfg: Any, steps: int) -> int:
    """Train ``steps`` steps of ``cfg`` and check where every tensor lives (see the module
    docstring); a sharded rank also saves a checkpoint and runs a held-out evaluation."""
    batches = []
    real = loop.optimize

    def spy(run, batch):  # type: ignore[no-untyped-def]
        batches.append(batch)
        return real(run, batch)

    loop.optimize = spy  # type: ignore[assignment]
    sharded = cfg.trainer.distributed.enabled
    rank = int(os.environ.get("RANK", "0"))
    tag = f"[rank {rank}] " if sharded else ""
    t0 = time.perf_counter()
    run = setup_run(cfg)
    say(f"{tag}setup (load, engine start, first sync): {time.perf_counter() - t0:.1f} s")
    try:
        if sharded and (world := _world(run)) and rank == 0:  # every rank gathers
            say(f"ran on: {world}")
        for _ in range(steps):
            m = loop.training_step(run)
            say(
                f"{tag}step {run.step}: rollout {m['time/rollout']:.2f} s, train "
                f"{m['time/train']:.2f} s, sync {m['time/sync']:.2f} s, reward "
                f"{m['reward/mean']:.3f}, logprob_gap {m.get('logprob_gap', float('nan')):.2e}, "
                f"canary_gap {m.get('engine/canary_gap', float('nan')):.2e}"
                + (f", episodes this rank {m['dist/episodes_this_rank']:.0f}" if sharded else "")
            )
        want = run.policy.device
        places = {
            "policy": {_local(p).device for p in run.policy.model.parameters()},
            "optimizer state": {
                _local(v).device
                for s in run.optimizer.state.values()
                for v in s.values()
                if isinstance(v, torch.Tensor) and v.dim() > 0
            },
            "batch": {t.device for b in batches for t in b.tensors().values()},
        }
        if sharded:
            t0 = time.perf_counter()
            ckpt = save(run)
            ev = run_eval(run)
            say(
                f"{tag}checkpoint {ckpt.name} and held-out eval ({len(ev['per_task'])} tasks, "
                f"pass@1 {ev['pass_at']['1']['mean']:.3f}): {time.perf_counter() - t0:.2f} s"
            )
    finally:
        close_run(run)
    bad = {k: v for k, v in places.items() if v != {want}}
    for k, v in places.items():
        say(f"{tag}{k}: {sorted(str(d) for d in v)}")
    if bad:
        say(f"{tag}NOT on {want}: {bad}")
        return 1
    say(f"{tag}every tensor on {want}")
    return 0


def _world(run: Any) -> str:
    """Backend, world size and each rank's device (one all-gather)."""
    import torch.distributed as dist

    from coderl.train.distributed import gather

    dev = run.policy.device
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    ranks = gather(f"{dev} ({name})")
    return f"{dist.get_backend()}, world size {dist.get_world_size()}: " + ", ".join(ranks)


if __name__ == "__main__":
    sys.exit(main())
