"""The GEMM floor: the matmul rates this CPU reaches for the demo model's shapes, fp32 and bf16.

The model is the one a config trains (default ``configs/repair.yaml``, the demo's), loaded as
``coderl train`` loads it (:func:`coderl.train.run.build_policy`: SmolLM2-135M-Instruct from its
GGUF, with the config's LoRA); the shapes are those of its ``nn.Linear`` layers (the decoder's
projections and the LM head; LoRA's own small matrices are left out), read from the loaded
model, not written down here. Each shape ``[M, K] @ [K, N]`` is timed through ``F.linear`` (as
the model runs it) in fp32 and in bf16, for the row counts ``M`` each phase of the demo feeds it:

- ``prefill``: one prompt of ``--prompt-tokens`` tokens (the sampler prefills each distinct
  prompt alone, unpadded); no LM head (logits of the last position only);
- ``decode-rollout``, ``decode-eval``: ``rollout.concurrency`` and ``eval.batch_episodes`` rows,
  one token each, LM head included (every step's logits);
- ``train``: a packed micro-batch of ``trainer.max_tokens_per_micro_batch`` tokens, the forward
  GEMM ``[M, K] @ [K, N]`` and the backward's data-gradient GEMM ``[M, N] @ [N, K]`` (LoRA: the
  frozen weights get no weight gradient); no LM head (it runs on the scored tokens only).

Printed: the CPU model, its flags (avx2, avx512f, avx512_bf16, amx_bf16, amx_tile), torch's
thread count (default: torch's own, which the demo keeps), GFLOP/s per shape, M and dtype; per
phase the rate of one pass through every linear layer of the model (its FLOPs over the sum of
each GEMM's measured time: what the phase's matmuls would reach with nothing else running),
in fp32, bf16 and ``bf16-mlp`` (the trainer's ``bf16``: the MLP's GEMMs in bf16, the
attention projections in fp32); and the peak, the best rate of any shape, per dtype. ``--json``
writes it all for ``bench/demo_profile.py``.

FLOPs of a GEMM: ``2 M K N`` (one multiply and one add per term). Timed: best of
``--repeats`` runs, each the mean over as many calls as fill ``--min-time`` seconds, after two
warm-up calls. On a loaded machine the rates are a share of the cores: measure on a quiet one.

    .venv/bin/python bench/gemm_floor.py                                # the demo's shapes
    .venv/bin/python bench/gemm_floor.py --json runs/gemm_floor.json    # + the table as JSON
    .venv/bin/python bench/gemm_floor.py --model tiny-random --min-time 0.01   # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

DEMO_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "repair.yaml"
FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
"""The ``/proc/cpuinfo`` flags that decide the GEMM rates printed."""
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Linear:
    """One weight shape of the model: ``count`` layers of ``in_features`` x ``out_features``;
    ``kind`` is ``attn`` (q, k, v, o projections), ``mlp`` or ``head`` (the LM head)."""

    kind: str
    in_features: int
    out_features: int
    count: int


@dataclass(frozen=True)
class ModelShape:
    """What a FLOP count of the model needs (read from the loaded model and its config)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    decoder_linear_params: int
    """Weights of the decoder's linear layers (no embedding, no LM head, no LoRA)."""
    lora_params: int
    """Trainable LoRA weights (0 without LoRA)."""
    linears: tuple[Linear, ...]


def model_shape(model: torch.nn.Module) -> ModelShape:
    """The :class:`ModelShape` of a (peft-wrapped or plain) Hugging Face causal LM."""
    from coderl.policy.kvcache import causal_lm

    lm = causal_lm(model)
    c = lm.config
    counts: Counter[tuple[str, int, int]] = Counter()
    for name, m in lm.named_modules():
        if not isinstance(m, torch.nn.Linear) or "lora_" in name:
            continue
        kind = "head" if name.endswith("lm_head") else "mlp" if ".mlp." in name else "attn"
        counts[(kind, m.in_features, m.out_features)] += 1
    linears = tuple(Linear(k, i, o, n) for (k, i, o), n in sorted(counts.items()))
    lora = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    heads = c.num_attention_heads
    return ModelShape(
        layers=c.num_hidden_layers,
        hidden=c.hidden_size,
        heads=heads,
        kv_heads=c.num_key_value_heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
        intermediate=c.intermediate_size,
        vocab=c.vocab_size,
        decoder_linear_params=sum(
            x.in_features * x.out_features * x.count for x in linears if x.kind != "head"
        ),
        lora_params=lora,
        linears=linears,
    )


def gemm_rate(M: int, K: int, N: int, dtype: torch.dtype, min_time: float, repeats: int) -> float:
    """Measured GFLOP/s of ``F.linear`` on ``[M, K]`` inputs and an ``[N, K]`` weight in
    ``dtype`` (``2 M K N`` FLOPs a call): the best of ``repeats`` runs, each the mean over
    enough calls to last ``min_time`` seconds, after two warm-up calls."""
    a, w = torch.randn(M, K, dtype=dtype), torch.randn(N, K, dtype=dtype)
    for _ in range(2):
        F.linear(a, w)
    best = 0.0
    for _ in range(repeats):
        calls, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < min_time or calls == 0:
            F.linear(a, w)
            calls += 1
        best = max(best, 2 * M * K * N * calls / elapsed / 1e9)
    return best


PHASE_MODES = {"fp32": ("fp32", "fp32"), "bf16": ("bf16", "bf16"), "bf16-mlp": ("fp32", "bf16")}
"""Dtype of (attention projections and LM head, MLP) GEMMs per precision mode."""


def phase_gemms(phase: str, shape: ModelShape) -> list[tuple[Linear, int, int]]:
    """The GEMMs of one pass of ``phase`` through the model as ``(layer, K, N)``, the input's
    inner and the output's size (see the module docstring for which layers each phase runs)."""
    out = []
    for x in shape.linears:
        if x.kind == "head" and phase in ("prefill", "train"):
            continue
        out.append((x, x.in_features, x.out_features))
        if phase == "train":  # the data gradient: [M, N] @ [N, K]
            out.append((x, x.out_features, x.in_features))
    return out


def measure(
    shape: ModelShape, rows: dict[str, int], min_time: float, repeats: int
) -> dict[str, object]:
    """Rates per shape and dtype for each phase's ``rows`` (phase -> M), per-phase pass rates
    per precision mode, and the peak per dtype (see the module docstring)."""
    rates: dict[tuple[str, int, int, int], float] = {}
    table = []
    phases: dict[str, dict[str, float]] = {}
    for phase, M in rows.items():
        gemms = phase_gemms(phase, shape)
        for dt in DTYPES:
            for _, K, N in gemms:
                key = (dt, M, K, N)
                if key not in rates:
                    rates[key] = gemm_rate(M, K, N, DTYPES[dt], min_time, repeats)
                    table.append({"dtype": dt, "M": M, "K": K, "N": N, "gflops": rates[key]})
                    print(f"  {dt} M={M:5d} {K:6d} x {N:6d}: {rates[key]:7.1f} GFLOP/s", flush=True)
        phases[phase] = {}
        for mode, (attn_dt, mlp_dt) in PHASE_MODES.items():
            flops = seconds = 0.0
            for x, K, N in gemms:
                f = 2.0 * M * K * N * x.count
                flops += f
                seconds += f / (rates[(mlp_dt if x.kind == "mlp" else attn_dt, M, K, N)] * 1e9)
            phases[phase][mode] = flops / seconds / 1e9
    peak = {dt: max(r["gflops"] for r in table if r["dtype"] == dt) for dt in DTYPES}
    return {"rates": table, "phases": phases, "peak": peak}


def demo_rows(cfg, prompt_tokens: int) -> dict[str, int]:
    """Phase -> GEMM rows ``M`` for the config's recipe (see the module docstring)."""
    return {
        "prefill": prompt_tokens,
        "decode-rollout": cfg.rollout.concurrency,
        "decode-eval": cfg.eval.batch_episodes,
        "train": cfg.trainer.max_tokens_per_micro_batch,
    }


def machine() -> dict[str, object]:
    """The CPU model, the :data:`FLAGS` it has, torch's threads and version, the load."""
    from coderl.policy.precision import cpu_info

    model, flags = cpu_info()
    return {
        "cpu": model,
        "flags": [f for f in FLAGS if f in flags],
        "cpus": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "capability": torch.backends.cpu.get_cpu_capability(),
        "load": list(os.getloadavg()),
    }


def floor(
    config: Path, overrides: list[str], model: str | None, prompt_tokens: int, min_time: float,
    repeats: int,
) -> dict[str, object]:  # fmt: skip
    """Load the config's model, print the machine, measure (:func:`measure`); returns the
    machine, the rows, the model's shape and the measured rates as one JSON-able dict."""
    from coderl.config import load_config
    from coderl.train.run import build_policy

    cfg = load_config(config, overrides + ([f"model.name={model}"] if model else []))
    shape = model_shape(build_policy(cfg, reference=False).model)
    info = machine()
    print(f"CPU {info['cpu']}; flags {' '.join(info['flags']) or 'none of ' + ', '.join(FLAGS)}; "
          f"{info['cpus']} CPUs, torch {info['torch']} ({info['capability']}), "
          f"{info['threads']} threads; load {info['load']}")  # fmt: skip
    print(f"model {cfg.model.name}: {shape.layers} layers, hidden {shape.hidden}, intermediate "
          f"{shape.intermediate}, {shape.heads} heads / {shape.kv_heads} KV heads of "
          f"{shape.head_dim}, vocab {shape.vocab}; decoder linear weights "
          f"{shape.decoder_linear_params / 1e6:.1f}M, LoRA {shape.lora_params / 1e6:.2f}M")  # fmt: skip
    rows = demo_rows(cfg, prompt_tokens)
    result = measure(shape, rows, min_time, repeats)
    print("one pass through the linear layers (GFLOP/s):")
    print(f"{'phase':>15} {'M':>6} " + " ".join(f"{m:>9}" for m in PHASE_MODES))
    for phase, by_mode in result["phases"].items():  # type: ignore[union-attr]
        cells = " ".join(f"{by_mode[m]:9.1f}" for m in PHASE_MODES)
        print(f"{phase:>15} {rows[phase]:6d} {cells}")
    peak = result["peak"]
    print(f"peak (best shape): fp32 {peak['fp32']:.1f}, bf16 {peak['bf16']:.1f} GFLOP/s")  # type: ignore[index]
    print(f"load at the end {os.getloadavg()}")
    return {**info, "config": str(config), "rows": rows, "model": asdict(shape), **result}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=DEMO_CONFIG)
    ap.add_argument("--model", help="another model spec (e.g. tiny-random for a smoke run)")
    ap.add_argument("--prompt-tokens", type=int, default=384, help="prefill rows (one prompt)")
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's, as the demo)")
    ap.add_argument("--min-time", type=float, default=0.3, help="seconds per timed run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, help="write the measurement here")
    ap.add_argument("overrides", nargs="*", help="key=value overrides of the config")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    out = floor(
        args.config, args.overrides, args.model, args.prompt_tokens, args.min_time, args.repeats
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
