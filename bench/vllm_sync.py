"""Full-weight sync into vLLM: seconds per GB to write, reload and canary-check a policy's weights.

    .venv/bin/python bench/vllm_sync.py [--models tiny-random smollm2-135m] [--syncs 5]

For each model a fully fine-tuned policy (``model.lora=false``) gets its vLLM engine from
``build_engine`` (a float32 server from ``.venv-vllm`` with the development endpoints, started
from the policy's untied weights); then ``--syncs`` times its weights are perturbed (a stand-in
for an optimizer step: every tensor changes), its version bumped and the engine synced
(:meth:`coderl.policy.vllm_engine.VLLMEngine.sync_full`). Per sync the engine times:

- ``write``: ``save_pretrained``-style safetensors of every weight into a new directory;
- ``reload``: pause, ``collective_rpc reload_weights``, prefix-cache reset, weight-version stamp,
  resume, and reading the version back;
- ``canary``: the server and the trainer scoring the fixed probe.

Printed: the median of each phase in seconds and in seconds per GB of the written safetensors,
the canary gap of every sync (it must stay below ``engine.canary_max_gap``: a sync that did not
take raises), the CPU flags and the load before and after. The server start is not counted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from grading import cpu_flags  # noqa: E402 - a sibling bench script

from coderl.config import Config  # noqa: E402
from coderl.policy import load_policy  # noqa: E402
from coderl.policy.rollout import build_engine  # noqa: E402


def bench_model(name: str, syncs: int, run_dir: Path) -> None:
    policy = load_policy(name, reference=False)
    cfg = Config.model_validate(
        {"run_dir": str(run_dir), "model": {"name": name, "lora": False},
         "engine": {"kind": "vllm", "dtype": "float32", "max_model_len": 1024,
                    "kv_cache_gib": 1, "ready_timeout_s": 900}}
    )  # fmt: skip
    start = time.perf_counter()
    rollout = build_engine(cfg, policy)
    print(f"{name}: server start + first sync {time.perf_counter() - start:.1f} s")
    engine = rollout.engine
    times: dict[str, list[float]] = {"write": [], "reload": [], "canary": []}
    gaps, size = [], 0
    try:
        g = torch.Generator().manual_seed(0)
        for _ in range(syncs):
            with torch.no_grad():
                for p in policy.model.parameters():
                    p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype), alpha=1e-3)
            policy.bump_version()
            gaps.append(engine.sync(policy))
            size = sum(f.stat().st_size for f in engine._weights.glob("*.safetensors"))
            for k, v in engine.last_sync_s.items():
                times[k].append(v)
    finally:
        rollout.close()
    gb = size / 1e9
    print(f"{name}: {size / 1e6:.1f} MB of safetensors per sync, {syncs} syncs, "
          f"canary gaps {', '.join(f'{x:.1e}' for x in gaps)} nats")  # fmt: skip
    print(f"{'phase':<8} {'median s':>10} {'s per GB':>10}")
    for k, v in times.items():
        med = statistics.median(v)
        print(f"{k:<8} {med:>10.3f} {med / gb:>10.2f}")
    total = sum(statistics.median(v) for v in times.values())
    print(f"{'total':<8} {total:>10.3f} {total / gb:>10.2f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["tiny-random", "smollm2-135m"])
    ap.add_argument("--syncs", type=int, default=5)
    args = ap.parse_args()
    print(f"{time.strftime('%Y-%m-%d %H:%M')} cpu: {cpu_flags()}; load {os.getloadavg()}; "
          f"torch threads {torch.get_num_threads()}")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="vllm-sync-") as tmp:
        for name in args.models:
            bench_model(name, args.syncs, Path(tmp) / name)
    print(f"load at the end {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
