"""Trainer throughput: coderl's forward + backward vs the plain Hugging Face forward, same run.

Model: SmolLM2-135M-Instruct with LoRA (rank 16, all linear layers), fp32 on CPU. Batch: ``--rows``
sequences shaped like the demo's harness episodes: a shared ``--system`` token prefix (system
prompt and tool schemas), a per-row task prompt of ``--prompt`` tokens, then ``--action``
sampled (trainable) tokens. Three ways to get the sampled tokens' logprobs, each followed by the
backward of their sum, timed over ``--reps`` repetitions after a warm-up (median):

- ``hf``: ``model(input_ids, ...)`` -> ``[B, T, V]`` logits, log-softmax at the sampled positions
  (what a trainer does without coderl);
- ``coderl, no sharing``: :func:`coderl.policy.forward.forward` with the shared-prefix path off (LM
  head only on the sampled positions);
- ``coderl``: :func:`coderl.policy.forward.forward` as used (shared prefix run once per micro-batch);
- ``coderl bf16``: the same under bf16 autocast (``trainer.bf16``; the LM head's logits and the
  log-softmax stay fp32).

Prints trained tokens (all positions) per second and the ratios to ``hf``, the max |logprob|
difference to ``hf``, and for bf16 the LoRA gradient's agreement with fp32 (cosine and relative L2
error of the flattened adapter gradient).

    .venv/bin/python bench/train.py                  # 4 rows, 284 + 170 + 140 tokens
    .venv/bin/python bench/train.py --model tiny-random --reps 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import coderl.policy.forward as fwd
from coderl.policy import LoraSpec, load_policy
from coderl.train.batch import build_batch
from coderl.trajectory import Segment


def segments(args: argparse.Namespace, vocab: int) -> list[Segment]:
    g = torch.Generator().manual_seed(0)
    system = torch.randint(10, vocab, (args.system,), generator=g).tolist()
    out = []
    for _ in range(args.rows):
        prompt = torch.randint(10, vocab, (args.prompt,), generator=g).tolist()
        action = torch.randint(10, vocab, (args.action,), generator=g).tolist()
        seg = Segment()
        seg.append_context(system + prompt)
        seg.append_sampled(action, [-1.0] * len(action), 0)
        out.append(seg)
    return out


def hf_logp(model: torch.nn.Module, batch) -> torch.Tensor:
    t = batch.tokens
    logits = model(
        input_ids=t.input_ids, attention_mask=t.attention_mask, position_ids=t.position_ids
    ).logits  # (B, T, V)
    sampled = t.loss_mask[:, 1:] > 0
    logp = logits[:, :-1][sampled].float().log_softmax(-1)  # (N, V)
    return logp.gather(-1, t.input_ids[:, 1:][sampled].unsqueeze(-1)).squeeze(-1)


def coderl_logp(model: torch.nn.Module, batch, share: bool, bf16: bool = False) -> torch.Tensor:
    fwd.MIN_SHARED_CONTEXT = 16 if share else 10**9
    out = fwd.forward(model, batch.tokens, temperature=1.0, bf16=bf16)
    return out.logp[:, 1:][batch.tokens.loss_mask[:, 1:] > 0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--system", type=int, default=284)
    ap.add_argument("--prompt", type=int, default=170)
    ap.add_argument("--action", type=int, default=140)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ways", nargs="+", help="a subset of the paths (default: all)")
    ap.add_argument("--cpu-time", action="store_true", help="time CPU seconds (a loaded machine)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    policy = load_policy(args.model, lora=LoraSpec(rank=16, alpha=32), reference=False)
    batch = build_batch(
        segments(args, policy.tokenizer.vocab_size), [1.0] * args.rows, policy.pad_token_id
    )
    tokens = int(batch.tokens.attention_mask.sum())
    ways = {
        "hf": lambda: hf_logp(policy.model, batch),
        "coderl, no sharing": lambda: coderl_logp(policy.model, batch, False),
        "coderl": lambda: coderl_logp(policy.model, batch, True),
        "coderl bf16": lambda: coderl_logp(policy.model, batch, True, bf16=True),
    }
    ways = {k: v for k, v in ways.items() if not args.ways or k in args.ways}
    rates, logps, grads = {}, {}, {}
    for name, fn in ways.items():
        times = []
        for _ in range(args.reps + 1):  # the first is a warm-up, not timed
            policy.model.zero_grad()
            t0 = time.process_time() if args.cpu_time else time.perf_counter()
            lp = fn()
            lp.sum().backward()
            times.append((time.process_time() if args.cpu_time else time.perf_counter()) - t0)
        times = times[1:]
        rates[name], logps[name] = tokens / statistics.median(times), lp.detach()
        grads[name] = torch.cat([p.grad.flatten() for p in policy.trainable_parameters()])
    print(
        f"model {args.model}, LoRA r16, {args.rows} rows x ({args.system} shared + "
        f"{args.prompt} prompt + {args.action} sampled) tokens, {args.threads} threads"
    )
    first = next(iter(rates))
    print(f"{'path':>20}  tokens/s{' per CPU-s' if args.cpu_time else ''}  ratio to {first}")
    for name, r in rates.items():
        print(f"{name:>20}  {r:8.1f}  {r / rates[first]:.2f}x")
    for name in ways:
        gap = float((logps[name] - logps[first]).abs().max())
        print(f"{name:>20}: max |logprob - {first} logprob| over the sampled tokens {gap:.2e}")
    if "coderl" in grads and "coderl bf16" in grads:
        g32, g16 = grads["coderl"], grads["coderl bf16"]
        cos = float(torch.nn.functional.cosine_similarity(g32, g16, dim=0))
        rel = float((g16 - g32).norm() / g32.norm())
        print(f"bf16 autocast LoRA gradient vs fp32: cosine {cos:.5f}, relative L2 error {rel:.2e}")


if __name__ == "__main__":
    main()
