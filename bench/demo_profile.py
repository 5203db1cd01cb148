"""Where the demo's CPU-seconds go: per phase wall seconds, CPU seconds, FLOPs, and the
fraction of this CPU's GEMM floor (``bench/gemm_floor.py``) each phase reaches.

Runs ``coderl demo`` (``configs/repair.yaml``, the recipe ``make demo`` runs; ``--short`` cuts it
with command-line overrides, the recipe's files are not changed) in a child process, timed with
``os.wait4`` (wall, CPU seconds and peak RSS of the demo and every process it waited for), or
reads a finished run directory (``--read``). Then it measures the GEMM floor for the run's
shapes in this process (or reads ``--floor``, a ``gemm_floor.py --json`` file) and prints one
row per phase: SFT (model load, oracle demonstrations and the SFT batches), each held-out
evaluation, rollout and grading summed over the RL steps, the trainer step, and the rest
(model load, checkpoints, the engine sync, the report: the demo's wall and CPU minus the
phases'). What the run records, and where:

- ``phases.json``: wall and CPU seconds of SFT and of the training call (``coderl demo``);
- ``sft/metrics.jsonl``: per SFT batch ``forward_tokens``, ``forward_attended``,
  ``trained_tokens``;
- ``eval.jsonl``: per evaluation ``time_s`` and ``perf`` (``cpu_s/eval``, the engine counters);
- ``metrics.jsonl``: per RL step ``time/<span>`` and ``cpu_s/<span>`` (rollout, grading, train),
  the sampler's ``engine/*`` counters and the trainer's ``forward_tokens``,
  ``forward_attended`` and ``trained_tokens``.

FLOPs (model FLOPs, as in PaLM's MFU, Chowdhery et al. 2022, Appendix B: what the model needs,
not what the kernels run; activation-checkpointing recompute and padding computed by a kernel
are not counted). Per token position, forward ``2 N`` for the ``N`` weights of the decoder's
linear layers (Kaplan et al. 2020, Sec. 2.1, Table 1), per causal query-key pair ``4 L H d_h``
(``Q K^T`` and ``A V``, ``2 L H d_h`` each: PaLM's ``12 L H Q T`` per trained token is 3x the
forward's ``4 L H Q T`` with every token seeing ``T`` positions; here the pairs are counted
exactly, causally), and ``2 d V`` per row of logits (the LM head: every decode step's rows,
the trainer's scored tokens; a prefill's last position is not counted). Backward: ``2x`` the
forward for trained weights (Kaplan, Sec. 2.1); with LoRA the frozen weights need only the
data gradient (``1x`` their forward: ``2 N`` per position, ``2 d V`` per logit row), the
adapters' ``N_lora`` weights both (``4 N_lora``), and attention's backward is ``2x`` its
forward. So a LoRA trainer step is ``(4 N + 6 N_lora) P + 12 L H d_h A + 4 d V S`` for ``P``
positions, ``A`` pairs and ``S`` scored tokens; full fine-tuning ``6 N P + 12 L H d_h A +
6 d V S``. The sampler's copy has the adapters merged (no LoRA term).

Floor: the time the phase's FLOPs would take at the GEMM rate ``gemm_floor.py`` measures for
one pass of the phase's GEMMs (its ``M``, its dtype: the sampler's ``engine.dtype``, the
trainer's ``bf16`` MLPs), attention's FLOPs counted at that rate too; the fraction of the floor
is that time over the phase's wall time. Per CPU-second is the steadier figure on a shared
machine. Grading (tests in sandboxes) and the rest do no model FLOPs: their seconds are the
share no matmul speed-up moves.

    .venv/bin/python bench/demo_profile.py --short          # a cut demo, ~10 min on 2 idle cores
    .venv/bin/python bench/demo_profile.py                  # the full demo (make demo's recipe)
    .venv/bin/python bench/demo_profile.py --read runs/profile --floor runs/gemm_floor.json
    .venv/bin/python bench/demo_profile.py --short --model tiny-random --min-time 0.01  # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from gemm_floor import DEMO_CONFIG, ModelShape, floor  # noqa: E402

SHORT = ["sft.limit=32", "trainer.steps=3", "eval.tasks=8"]
"""``--short``: a quarter of the demonstrations, half the RL steps and a quarter of the held-out
tasks; the shapes (prompts, rows sampled together, micro-batches) stay the demo's."""
WORK = ("forward_tokens", "forward_attended", "trained_tokens")
"""The trainer's work counts: positions, causal query-key pairs, scored tokens."""
FLOP_COUNTERS = ("prefilled_tokens", "prefill_attended", "decoded_tokens", "decode_attended")
"""The sampler counters a FLOP count reads (of ``coderl.policy.engine.ENGINE_COUNTERS``)."""
RUN_FILE = "profile_run.json"
"""What the child process measured, kept in the run directory for ``--read``."""


def run_demo(config: Path, run_dir: Path, overrides: list[str]) -> dict[str, Any]:
    """Run ``coderl demo`` in a child process; returns its command, wall and CPU seconds (its
    own and every descendant it waited for: ``os.wait4``) and peak RSS (GB, the largest single
    process), also written to ``run_dir/profile_run.json``.

    Raises:
        SystemExit: the demo failed (its exit status)."""
    cmd = [sys.executable, "-m", "coderl", "demo", "--config", str(config), f"run_dir={run_dir}"]
    cmd += overrides
    print("running:", shlex.join(cmd), flush=True)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"the demo failed: exit {os.waitstatus_to_exitcode(status)}")
    out = {
        "command": shlex.join(cmd),
        "wall_s": wall,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "peak_rss_gb": usage.ru_maxrss / 1024**2,
        "load_after": list(os.getloadavg()),
    }
    (run_dir / RUN_FILE).write_text(json.dumps(out, indent=1) + "\n")
    return out


def forward_flops(m: ModelShape, positions: float, pairs: float, logit_rows: float) -> float:
    """Forward FLOPs without LoRA: ``2 N`` per position, ``4 L H d_h`` per causal query-key
    pair, ``2 d V`` per row of logits (see the module docstring for the sources)."""
    attn = 4.0 * m.layers * m.heads * m.head_dim
    head = 2.0 * m.hidden * m.vocab * logit_rows
    return 2.0 * m.decoder_linear_params * positions + attn * pairs + head


def train_flops(m: ModelShape, positions: float, pairs: float, scored: float) -> float:
    """Forward + backward FLOPs of a trainer pass (module docstring): LoRA ``(4 N + 6 N_lora)
    P + 12 L H d_h A + 4 d V S``; full fine-tuning (``lora_params == 0``) ``6 N P + 12 L H d_h
    A + 6 d V S``."""
    fwd = forward_flops(m, positions, pairs, scored)
    attn = 4.0 * m.layers * m.heads * m.head_dim * pairs
    head = 2.0 * m.hidden * m.vocab * scored
    if m.lora_params == 0:
        return 3.0 * fwd
    linear = 2.0 * m.decoder_linear_params * positions
    return fwd + linear + 2.0 * attn + head + 6.0 * m.lora_params * positions


def sampler_parts(
    m: ModelShape, perf: dict[str, float], decode_phase: str
) -> list[tuple[float, str]]:
    """(FLOPs, floor phase) of a sampling span's prefill and decode from its engine counters."""
    n = {k: perf.get(f"engine/{k}", 0.0) for k in FLOP_COUNTERS}
    prefill = forward_flops(m, n["prefilled_tokens"], n["prefill_attended"], 0.0)
    decode = forward_flops(m, n["decoded_tokens"], n["decode_attended"], n["decoded_tokens"])
    return [(prefill, "prefill"), (decode, decode_phase)]


def phase_rows(run: Path, shape: ModelShape, modes: dict[str, str]) -> list[dict[str, Any]]:
    """One row per phase: ``name``, ``wall``, ``cpu`` (s, the process and its reaped children)
    and ``parts``: ``(FLOPs, floor phase, precision mode)``."""
    from coderl.metrics import EXTRA_EVAL_FILE, SFT_LOG, read_jsonl

    phases = json.loads((run / "phases.json").read_text())
    rows: list[dict[str, Any]] = []
    if "sft_s" in phases:
        sft = read_jsonl(run / SFT_LOG)
        work = [sum(r.get(k, 0.0) for r in sft) for k in WORK]
        f = train_flops(shape, *work)
        cpu = phases["sft_cpu_s"] + phases["sft_children_cpu_s"]
        rows.append(
            {
                "name": "SFT (not run: reused from cache)" if phases.get("sft_reused") else "SFT",
                "wall": phases["sft_s"],
                "cpu": cpu,
                "parts": [(f, "train", modes["sft"])],
            }
        )
    for e in read_jsonl(run / "eval.jsonl") + read_jsonl(run / EXTRA_EVAL_FILE):
        perf = e.get("perf", {})
        parts = [(f, p, modes["sampler"]) for f, p in sampler_parts(shape, perf, "decode-eval")]
        cpu = perf.get("cpu_s/eval", 0.0) + perf.get("cpu_s/eval_children", 0.0)
        split = f"{e['split']} " if "split" in e else ""  # eval.extra_splits
        name = f"eval {split}{e.get('phase') or 'after RL'} (step {e['step']})"
        rows.append({"name": name, "wall": e["time_s"], "cpu": cpu, "parts": parts})
    steps = read_jsonl(run / "metrics.jsonl")

    def total(key: str) -> float:
        return sum(s.get(key, 0.0) for s in steps)

    counters = {k: total(k) for k in {k for s in steps for k in s if k.startswith("engine/")}}
    for span in ("rollout", "grading", "train"):
        cpu = total(f"cpu_s/{span}") + total(f"cpu_s/{span}_children")
        parts: list[tuple[float, str, str]] = []
        if span == "rollout":
            parts = [
                (f, p, modes["sampler"])
                for f, p in sampler_parts(shape, counters, "decode-rollout")
            ]
        elif span == "train":
            f = train_flops(shape, *(total(k) for k in WORK))
            parts = [(f, "train", modes["train"])]
        name = {"rollout": f"RL rollout ({len(steps)} steps)", "grading": "RL grading"}.get(
            span, "RL trainer step"
        )
        rows.append({"name": name, "wall": total(f"time/{span}"), "cpu": cpu, "parts": parts})
    return rows


def precision_modes(run: Path) -> dict[str, str]:
    """The floor's precision mode of the sampler, the trainer and SFT, from the run's config on
    this machine (``auto`` resolved by this CPU's flags)."""
    import torch

    from coderl.config import load_config
    from coderl.policy.precision import resolve_precision
    from coderl.train.sft import sft_bf16
    from coderl.train.step import uses_bf16

    cfg = load_config(run / "config.yaml")
    sampler = "bf16" if resolve_precision(cfg.engine.dtype) == torch.bfloat16 else "fp32"
    train = "bf16-mlp" if uses_bf16(cfg.trainer, torch.device("cpu")) else "fp32"
    return {"sampler": sampler, "train": train, "sft": "bf16-mlp" if sft_bf16(cfg) else "fp32"}


COLUMNS = ("wall s", "wall %", "CPU s", "CPU %", "GFLOP", "GFLOP/s", "GFLOP/CPU-s", "floor s",
           "% floor", "% floor CPU")  # fmt: skip
"""The table's columns (:func:`cells`)."""


def cells(r: dict[str, Any], total: dict[str, Any], threads: int) -> list[float]:
    """A phase row's numbers: wall and CPU seconds and their shares of ``total``; GFLOP,
    GFLOP per wall second and per CPU-second; the floor's seconds and the fraction of the floor
    by wall time (``floor_s / wall``) and by CPU time (``floor_s * threads / cpu``: the CPU-
    seconds the floor's GEMMs would keep ``threads`` cores busy, over those spent; the steadier
    one on a shared machine). NaN where the phase does no model FLOPs."""
    wall, cpu, gflop, floor_s = r["wall"], r["cpu"], r["gflop"], r["floor_s"]
    out = [wall, 100 * wall / total["wall"], cpu, 100 * cpu / total["cpu"]]
    if not gflop:
        return out + [float("nan")] * 6
    tiny = 1e-9
    return out + [gflop, gflop / max(wall, tiny), gflop / max(cpu, tiny), floor_s,
                  100 * floor_s / max(wall, tiny), 100 * floor_s * threads / max(cpu, tiny)]  # fmt: skip


def report(run: Path, measured: dict[str, Any], gemm: dict[str, Any]) -> list[dict[str, Any]]:
    """Print the phase table against the floor ``gemm`` (a :func:`gemm_floor.floor` result);
    returns its rows (also written to ``run/profile.json``)."""
    shape = ModelShape(**{**gemm["model"], "linears": ()})
    modes = precision_modes(run)
    rows = phase_rows(run, shape, modes)
    rows.append({"name": "other (load, checkpoints, sync, report)", "parts": [],
                 "wall": measured["wall_s"] - sum(r["wall"] for r in rows),
                 "cpu": measured["cpu_s"] - sum(r["cpu"] for r in rows)})  # fmt: skip
    print(f"\nrun {run}: {measured['wall_s'] / 60:.1f} min wall, {measured['cpu_s']:.0f} CPU-s, "
          f"peak RSS {measured.get('peak_rss_gb', float('nan')):.2f} GB; sampler {modes['sampler']}, "
          f"trainer {modes['train']}, SFT {modes['sft']}; floor: {gemm['cpu']}, "
          f"{' '.join(gemm['flags'])}, {gemm['threads']} threads, peak fp32 "
          f"{gemm['peak']['fp32']:.0f} / bf16 {gemm['peak']['bf16']:.0f} GFLOP/s")  # fmt: skip
    threads = gemm["threads"]
    for r in rows:
        r["gflop"] = sum(f for f, _, _ in r["parts"]) / 1e9
        r["floor_s"] = sum(f / (gemm["phases"][p][mode] * 1e9) for f, p, mode in r["parts"])
    total = {"name": "total", "wall": measured["wall_s"], "cpu": measured["cpu_s"]}
    total.update({k: sum(r[k] for r in rows) for k in ("gflop", "floor_s")})
    print(f"{'phase':<40}" + "".join(f"{h:>12}" for h in COLUMNS))
    for r in [*rows, total]:
        print(f"{r['name']:<40}" + "".join(f"{c:12.1f}" for c in cells(r, total, threads)))
    for r in rows:
        r.pop("parts")
    (run / "profile.json").write_text(
        json.dumps({"run": measured, "phases": rows}, indent=1) + "\n"
    )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=DEMO_CONFIG)
    ap.add_argument("--run-dir", type=Path, help="default: runs/profile or runs/profile-short")
    ap.add_argument("--short", action="store_true", help=f"the cut demo: {' '.join(SHORT)}")
    ap.add_argument("--read", type=Path, help="only read this finished run directory")
    ap.add_argument("--floor", type=Path, help="a gemm_floor.py --json file (default: measure)")
    ap.add_argument("--model", help="another model spec (tiny-random: a smoke run)")
    ap.add_argument("--min-time", type=float, default=0.3, help="gemm_floor's seconds per run")
    ap.add_argument("overrides", nargs="*", help="more key=value overrides of the config")
    args = ap.parse_args()
    overrides = (SHORT if args.short else []) + args.overrides
    overrides += [f"model.name={args.model}"] if args.model else []
    full = [".venv/bin/python", "bench/demo_profile.py", *args.overrides]
    if args.read:
        run = args.read
        measured = json.loads((run / RUN_FILE).read_text())
    else:
        run = args.run_dir or Path("runs/profile-short" if args.short else "runs/profile")
        measured = run_demo(args.config, run, overrides + ["progress=false"])
    if args.floor:
        gemm = json.loads(args.floor.read_text())
    else:
        steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        asked = sum(s.get("engine/prompt_tokens", 0.0) for s in steps)
        prompts = sum(s.get("engine/prompts", 0.0) for s in steps)
        tokens = round(asked / prompts) if prompts else 384
        print(f"\nGEMM floor (prefill rows: the mean prompt, {tokens} tokens):", flush=True)
        gemm = floor(args.config, overrides, None, tokens, args.min_time, repeats=3)
    report(run, measured, gemm)
    print(f"\nthe full demo's profile (without --short): {shlex.join(full)}")


if __name__ == "__main__":
    main()
