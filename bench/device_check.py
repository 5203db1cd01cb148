"""The prepared device check: load, sample, one training step, sync, canary, on ``--device``
(default ``auto``: the GPU when torch sees one) through ``--engine`` (``torch``, or ``vllm`` when a
vLLM interpreter is available: ``.venv-vllm`` or ``$CODERL_VLLM_PYTHON``). Not a test: run it on
a machine with an accelerator and keep its output with the date.

It trains ``--steps`` steps of the toy task (``configs/toy.yaml``, LoRA) through ``coderl train``'s
own functions, then checks that every parameter, optimizer state tensor and the step's batch live
on the configured device, and prints per-step timings, the canary gap (vLLM) and where each
tensor lives. Exits non-zero when a tensor is elsewhere.

    .venv/bin/python bench/device_check.py                      # auto device, torch engine
    .venv/bin/python bench/device_check.py --engine vllm --model smollm2-135m --steps 2
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from coderl.config import load_config
from coderl.train import loop
from coderl.train.run import close_run, setup_run

TOY = Path(__file__).resolve().parents[1] / "configs" / "toy.yaml"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--engine", default="torch", choices=["torch", "vllm"])
    ap.add_argument("--model", default="tiny-random")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    run_dir = tempfile.mkdtemp(prefix="coderl-device-")
    cfg = load_config(
        TOY,
        [
            f"run_dir={run_dir}", "progress=false", "tensorboard=false",
            "eval.before_after=false", f"model.name={args.model}", "model.lora=true",
            "model.lora_r=8", "trainer.lr=0.05", f"trainer.device={args.device}",
            f"engine.kind={args.engine}", "engine.max_model_len=1024", "algorithm.kl.coef=0.1",
        ],
    )  # fmt: skip
    batches = []
    real = loop.train_step

    def spy(model, optimizer, scheduler, batch, *a, **k):  # type: ignore[no-untyped-def]
        batches.append(batch)
        return real(model, optimizer, scheduler, batch, *a, **k)

    loop.train_step = spy  # type: ignore[assignment]
    t0 = time.perf_counter()
    run = setup_run(cfg)
    print(f"setup (load, engine start, first sync): {time.perf_counter() - t0:.1f} s")
    try:
        for _ in range(args.steps):
            m = loop.training_step(run)
            print(
                f"step {run.step}: rollout {m['time/rollout']:.2f} s, train {m['time/train']:.2f}"
                f" s, sync {m['time/sync']:.2f} s, reward {m['reward/mean']:.3f}, logprob_gap "
                f"{m.get('logprob_gap', float('nan')):.2e}, canary_gap "
                f"{m.get('engine/canary_gap', float('nan')):.2e}"
            )
        want = run.policy.device
        places = {
            "policy": {p.device for p in run.policy.model.parameters()},
            "optimizer state": {
                v.device
                for s in run.optimizer.state.values()
                for v in s.values()
                if isinstance(v, torch.Tensor) and v.dim() > 0
            },
            "batch": {t.device for b in batches for t in b.tensors().values()},
        }
    finally:
        close_run(run)
    bad = {k: v for k, v in places.items() if v != {want}}
    for k, v in places.items():
        print(f"{k}: {sorted(str(d) for d in v)}")
    if bad:
        print(f"NOT on {want}: {bad}")
        return 1
    print(f"every tensor on {want}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
