"""Are the function-repair tasks at the base model's frontier? SmolLM2-135M-Instruct, chat-style,
no tools and no SFT: the task statement plus "reply with the whole fixed file in one python
block"; the first fenced block of the reply is written as ``solution.py`` and graded by the
repair task's grader (``coderl.grading.grade.grade``). Prints the pass rate per split and level,
how many replies had no code block, and how many returned the buggy file unchanged.

    .venv/bin/python bench/repair_frontier.py                  # 16 tasks per split, greedy
    .venv/bin/python bench/repair_frontier.py --per-split 32 --samples 4 --temperature 1.0
"""

from __future__ import annotations

import argparse
import os
import time
from collections import defaultdict

from coderl.grading.grade import grade
from coderl.online.suites import extract_code
from coderl.policy.base import SamplingParams
from coderl.policy.loading import load_policy
from coderl.synth.fnrepair import level_of, repair_tasks
from coderl.tasks.patches import make_diff

ASK = "\n\nReply with the whole fixed solution.py in one ```python block."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-split", type=int, default=16)
    ap.add_argument("--samples", type=int, default=1)
    ap.add_argument("--temperature", type=float, default=1e-4, help="1e-4: about greedy")
    ap.add_argument("--max-new-tokens", type=int, default=320)
    a = ap.parse_args()
    print(f"load at start {os.getloadavg()}")
    tasks = [t for s in ("train", "heldout") for t in repair_tasks(s)[: a.per_split]]
    policy = load_policy("smollm2-135m", reference=False)
    tok = policy.tokenizer
    prompts = []
    for t in tasks:
        chat = [{"role": "user", "content": t.problem_statement + ASK}]
        text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        prompts += [tok(text, add_special_tokens=False)["input_ids"]] * a.samples
    t0 = time.perf_counter()
    params = SamplingParams(temperature=a.temperature, max_new_tokens=a.max_new_tokens, seed=0)
    outs = policy.generate(prompts, params)
    gen_s = time.perf_counter() - t0
    stats: dict[tuple[str, int], list[int]] = defaultdict(lambda: [0, 0])
    no_code = unchanged = 0
    for i, out in enumerate(outs):
        task = tasks[i // a.samples]
        buggy = task.workspace_files["solution.py"]
        code = extract_code(tok.decode(out.token_ids, skip_special_tokens=True))
        no_code += code is None
        unchanged += code is not None and code.strip() == buggy.strip()
        ok = code is not None and grade(task, make_diff("solution.py", buggy, code)).resolved
        key = (task.split, level_of(task) or 0)
        stats[key][0] += ok
        stats[key][1] += 1
    for (split, level), (ok, n) in sorted(stats.items()):
        print(f"{split:8s} level {level}: {ok}/{n} resolved")
    for split in ("train", "heldout"):
        ok = sum(v[0] for k, v in stats.items() if k[0] == split)
        n = sum(v[1] for k, v in stats.items() if k[0] == split)
        print(f"{split:8s} all: {ok}/{n} = {ok / max(n, 1):.3f}")
    print(
        f"{len(outs)} replies: {no_code} without a code block, {unchanged} the buggy file "
        f"unchanged; generation {gen_s:.0f} s"
    )
    print(f"load at end {os.getloadavg()}")


if __name__ == "__main__":
    main()
