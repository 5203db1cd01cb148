"""mini-swe-agent (unmodified, ``.venv-agents``) through the gateway on a real model: what share
of its calls parse under mini-swe-agent's format, and what the episodes cost.

Runs ``--tasks`` function-repair training tasks x ``--group`` episodes of
``configs/gateway-mini.yaml``'s program, sampling from ``--model`` (default the embedded
SmolLM2-135M-Instruct) at temperature 1.0, and prints per call: the share whose reply carries
a tool call mini-swe-agent runs (a ``bash`` call with a string ``command``, in the Hermes
format the model is told), the share with a broken call, the share with none; per episode:
finish reasons, resolved rate, segments, wall time; and the load average before and after.

    .venv/bin/python bench/gateway_mini.py                    # SmolLM2, 2 tasks x 2, 4 calls each
    .venv/bin/python bench/gateway_mini.py --tasks 4 --group 4 --max-turns 6
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import Counter
from pathlib import Path

from coderl.config import load_config
from coderl.endpoint.calls import parse_reply
from coderl.endpoint.chat import client_tools
from coderl.envs import build_environment
from coderl.policy import load_policy
from coderl.train.pipeline import sampling_params

ROOT = Path(__file__).parent.parent
BASH = {  # mini-swe-agent's BASH_TOOL (minisweagent/models/utils/actions_toolcall.py)
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Execute a bash command",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string"}},
            "required": ["command"],
        },
    },
}


class Recording:
    """The policy, keeping every completion's text."""

    def __init__(self, policy) -> None:
        self.policy, self.tokenizer, self.texts = policy, policy.tokenizer, []

    @property
    def version(self) -> int:
        return self.policy.version

    def generate(self, prompts, params):
        out = self.policy.generate(prompts, params)
        for c in out:
            ids = c.token_ids[:-1] if c.finish_reason == "stop" else c.token_ids
            self.texts.append(self.tokenizer.decode(ids, skip_special_tokens=False))
        return out


def runs_in_mini(text: str) -> str:
    """``runs`` (a bash call with a string command), ``broken`` or ``none``."""
    _, calls, status = parse_reply(text, client_tools([BASH]), "hermes")
    if status != "valid":
        return {"invalid": "broken"}.get(status, "none")
    ok = all(
        c["function"]["name"] == "bash"
        and isinstance(json.loads(c["function"]["arguments"]).get("command"), str)
        for c in calls
    )
    return "runs" if ok else "broken"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tasks", type=int, default=2)
    ap.add_argument("--group", type=int, default=2)
    ap.add_argument("--max-turns", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    args = ap.parse_args()
    os.chdir(ROOT)  # the config's program names $CODERL_LAUNCH_DIR/.venv-agents
    cfg = load_config(
        ROOT / "configs" / "gateway-mini.yaml",
        [
            f"model.name={args.model}",
            f"rollout.max_turns={args.max_turns}",
            f"rollout.max_new_tokens={args.max_new_tokens}",
        ],
    )
    env = build_environment(cfg)
    tasks = env.tasks("train")[: args.tasks]
    policy = Recording(load_policy(args.model, reference=False))
    load0 = os.getloadavg()[0]
    t = time.perf_counter()
    records = env.rollout(policy, tasks, sampling_params(cfg, seed=0), args.group)
    wall = time.perf_counter() - t
    grades = env.grade([t for t in tasks for _ in range(args.group)], records)
    kinds = Counter(runs_in_mini(x) for x in policy.texts)
    n = max(len(policy.texts), 1)
    print(f"model {args.model}: {len(records)} episodes, {len(policy.texts)} calls in {wall:.1f} s")
    print(
        f"calls that mini-swe-agent runs: {kinds['runs'] / n:.3f}; broken call: "
        f"{kinds['broken'] / n:.3f}; no call: {kinds['none'] / n:.3f}"
    )
    print(f"finish reasons: {dict(Counter(r.finish_reason for r in records))}")
    print(f"failures: {dict(Counter(r.failure for r in records))}")
    print(f"resolved: {sum(g.resolved for g in grades)}/{len(grades)}")
    print(f"segments per episode: {[len(r.trajectory.segments) for r in records]}")
    print(f"load average before/after: {load0:.2f} / {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
