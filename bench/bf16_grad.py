"""Where bf16 autocast's gradient error comes from: the LoRA gradient's cosine to fp32's with
each part of the model put back in fp32, on one batch, in one run.

Model: SmolLM2-135M-Instruct, LoRA r16 on every linear layer; loss: ``-mean(A * logp)`` over the
sampled tokens (advantages +-1). Batches: ``demo`` (natural text, :func:`learn.demo_segments`)
or ``random`` (uniform random token ids shaped like ``bench/train.py``'s: 284 shared + 170 prompt
+ 140 sampled tokens a row). Variants, each the gradient of one forward + backward under CPU
bf16 autocast except where named:

- ``autocast``: the whole forward under autocast, logits included (the bf16 trainer before);
- ``+head``: the LM head (and so the log-softmax) in fp32 on the fp32 hidden states;
- ``+head+lora``: also the LoRA adapters' two matmuls in fp32;
- ``+head+sdpa``: also the attention softmax (SDPA) in fp32, its projections in bf16;
- ``+head+attn``: the whole attention block (projections and SDPA) in fp32, MLPs in bf16;
- ``+head+mlp``: the MLPs in fp32, attention in bf16;
- ``shipped``: :func:`coderl.policy.forward.forward` with ``bf16=True``.

Prints, per variant, the cosine (fp64) and relative L2 error of the flattened LoRA gradient
against fp32's, the max and mean |logprob - fp32 logprob| over the sampled tokens, and seconds.

    .venv/bin/python bench/bf16_grad.py --batch demo --rows 8
    .venv/bin/python bench/bf16_grad.py --batch random --rows 4 --variants autocast +head shipped
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

import torch

VARIANTS = ("autocast", "+head", "+head+lora", "+head+sdpa", "+head+attn", "+head+mlp", "shipped")


def _fp32(x):
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.float()
    if isinstance(x, tuple):
        return tuple(_fp32(v) for v in x)
    return x


@contextlib.contextmanager
def fp32_modules(modules):
    """Run ``modules`` without autocast, their float inputs cast to fp32."""
    originals = []
    for m in modules:
        f = m.forward

        def g(*a, f=f, **k):
            with torch.autocast("cpu", enabled=False):
                return f(*[_fp32(v) for v in a], **{n: _fp32(v) for n, v in k.items()})

        m.forward = g
        originals.append(m)
    try:
        yield
    finally:
        for m in originals:
            del m.forward  # back to the class's forward


@contextlib.contextmanager
def fp32_sdpa():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def fp32(module, q, k, v, mask, **kw):
        with torch.autocast("cpu", enabled=False):
            return sdpa(module, q.float(), k.float(), v.float(), mask, **kw)

    ALL_ATTENTION_FUNCTIONS._global_mapping["sdpa"] = fp32
    try:
        yield
    finally:
        ALL_ATTENTION_FUNCTIONS._global_mapping["sdpa"] = sdpa


def variant_logp(policy, batch, name: str) -> torch.Tensor:
    """``[N]`` logprobs of the sampled tokens under variant ``name`` (None: fp32)."""
    from peft.tuners.lora import LoraLayer

    from coderl.policy.forward import forward
    from coderl.policy.kvcache import causal_lm

    t = batch.tokens
    scored = t.loss_mask[:, 1:] > 0
    if name == "shipped":
        return forward(policy.model, t, temperature=1.0, bf16=True).logp[:, 1:][scored]
    lm = causal_lm(policy.model)
    layers = lm.model.layers
    parts = {
        "lora": [
            d[k]
            for m in lm.modules()
            if isinstance(m, LoraLayer)
            for d in (m.lora_A, m.lora_B)
            for k in d
        ],  # fmt: skip
        "attn": [layer.self_attn for layer in layers],
        "mlp": [layer.mlp for layer in layers],
    }
    fp32 = [m for part, ms in parts.items() if name and f"+{part}" in name for m in ms]
    with contextlib.ExitStack() as stack:
        if name is not None:
            stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
            stack.enter_context(fp32_modules(fp32))
            if "+sdpa" in name:
                stack.enter_context(fp32_sdpa())
        args = dict(input_ids=t.input_ids, attention_mask=t.attention_mask)
        h = lm.model(**args, position_ids=t.position_ids).last_hidden_state  # (B, T, H)
        h = h[:, :-1][scored]  # (N, H)
        if name is None or "+head" not in name:
            logits = lm.lm_head(h)
    if name is not None and "+head" in name:
        logits = lm.lm_head(h.float())
    logp = logits.float().log_softmax(-1)  # (N, V)
    return logp.gather(-1, t.input_ids[:, 1:][scored].unsqueeze(-1)).squeeze(-1)


def random_segments(vocab: int, rows: int) -> list:
    from coderl.trajectory import Segment

    g = torch.Generator().manual_seed(0)
    system = torch.randint(10, vocab, (284,), generator=g).tolist()
    segs = []
    for _ in range(rows):
        seg = Segment()
        seg.append_context(system + torch.randint(10, vocab, (170,), generator=g).tolist())
        seg.append_sampled(torch.randint(10, vocab, (140,), generator=g).tolist(), [0.0] * 140, 0)
        segs.append(seg)
    return segs


def main() -> None:
    from learn import demo_segments

    from coderl.policy import LoraSpec, load_policy
    from coderl.policy.precision import bf16_flags
    from coderl.train.batch import build_batch

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batch", choices=["demo", "random"], default="demo")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"CPU bf16 flags: {bf16_flags() or 'none'}; load {os.getloadavg()}")
    torch.manual_seed(0)
    policy = load_policy(args.model, lora=LoraSpec(rank=16, alpha=32), reference=False)
    if args.batch == "demo":
        segs = demo_segments(policy.tokenizer, args.rows)
    else:
        segs = random_segments(policy.tokenizer.vocab_size, args.rows)
    batch = build_batch(segs, [1.0 if i % 2 else -1.0 for i in range(len(segs))], 0)
    scored = batch.tokens.loss_mask[:, 1:] > 0
    adv = batch.advantages[:, None].expand_as(scored)[scored]  # (N,)
    print(f"{args.batch} batch: {batch.size} rows, {int(batch.tokens.attention_mask.sum())} "
          f"tokens, {int(scored.sum())} sampled")  # fmt: skip
    results = {}
    for name in [None, *args.variants]:
        policy.model.zero_grad()
        t0 = time.perf_counter()
        logp = variant_logp(policy, batch, name)
        (-(adv * logp).mean()).backward()
        seconds = time.perf_counter() - t0
        grad = torch.cat([p.grad.flatten() for p in policy.trainable_parameters()]).double()
        results[name] = (grad, logp.detach(), seconds)
    g32, lp32, s32 = results.pop(None)
    print(f"{'variant':>11} {'cosine':>9} {'rel L2':>8} {'max|dlogp|':>10} {'mean':>8} {'s':>6}"
          f"   (fp32: {s32:.1f} s)")  # fmt: skip
    for name, (g, lp, s) in results.items():
        cos = float(torch.nn.functional.cosine_similarity(g, g32, dim=0))
        rel = float((g - g32).norm() / g32.norm())
        d = (lp - lp32).abs()
        print(f"{name:>11} {cos:9.5f} {rel:8.2e} {float(d.max()):10.3e} {float(d.mean()):8.1e} "
              f"{s:6.1f}")  # fmt: skip
    print(f"load at the end {os.getloadavg()}")


if __name__ == "__main__":
    main()
