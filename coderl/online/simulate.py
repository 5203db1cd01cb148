"""A simulated client population and the held-out evaluator, both on real HumanEval tasks.

The population exists to exercise the machinery end to end (serve -> events -> rewards ->
update -> gate), not to claim that simulated users teach the model. Each client calls
``coderl serve`` through the official ``openai`` client; an edit "persists" iff the hidden tests
pass, and the follow-up is dissatisfied iff the episode failed (no passing edit). Some outcome
events are dropped (censoring), sent twice (idempotency), or accompanied by a malformed event
(rejection), at configurable rates; a broken tool call produces a ``tool_error`` event.

Hidden tests run in :mod:`coderl.sandbox` (see :mod:`coderl.online.suites`); the population grades
each reply as it arrives, the evaluator grades all of its replies at once in a thread pool.
"""

from __future__ import annotations

import json
import random
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

from coderl.online.config import EvalSection, SimulateSection
from coderl.online.monitors import behaviour_metrics
from coderl.online.server import classify, parse_tool_calls
from coderl.online.suites import (
    SuiteTask,
    check_sandbox,
    extract_code,
    grade_replies,
    humaneval,
    passes,
)
from coderl.policy.base import SamplingParams
from coderl.policy.episode import encode, render

WRITE_FILE = {
    "type": "function",
    "function": {
        "name": "write_file",
        "description": "Write the complete content of a file.",
        "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
            "required": ["path", "content"],
        },
    },
}


@dataclass
class SimStats:
    requests: int = 0
    edits: int = 0
    passed: int = 0
    broken_calls: int = 0
    events_sent: int = 0
    duplicates_sent: int = 0
    malformed_sent: int = 0
    dropped: int = 0


def post_json(url: str, body: Any) -> tuple[int, dict[str, Any]]:
    """POST JSON; ``(status, decoded body)`` (HTTP errors are returned, not raised)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


@dataclass
class SimulatedPopulation:
    """Clients that call ``base_url`` (an OpenAI-compatible ``.../v1``) with traffic tasks."""

    base_url: str
    cfg: SimulateSection
    model: str = "coderl"
    tasks: list[SuiteTask] = field(default_factory=lambda: humaneval("traffic"))
    sandbox: str = "bwrap"
    """Where the hidden tests run (:data:`coderl.online.suites.GRADERS`)."""
    stats: SimStats = field(default_factory=SimStats)

    def __post_init__(self) -> None:
        check_sandbox(self.sandbox)
        from openai import OpenAI

        self._client = OpenAI(base_url=self.base_url, api_key="simulated")
        self._rng = random.Random(self.cfg.seed)

    def run(self, n: int) -> SimStats:
        """Send ``n`` requests and their outcome events; returns the cumulative stats."""
        for _ in range(n):
            self._one()
        return self.stats

    def _one(self) -> None:
        rng, s = self._rng, self.stats
        client_id = rng.randrange(self.cfg.clients)
        task = rng.choice(self.tasks)
        tools = [WRITE_FILE] if rng.random() < self.cfg.tool_share else None
        t0 = time.perf_counter()
        r = self._client.chat.completions.create(
            model=self.model,
            messages=task.messages(),  # type: ignore[arg-type]
            tools=tools,  # type: ignore[arg-type]
            seed=rng.randrange(2**31),
            extra_body={"population": f"org-{client_id % self.cfg.populations}"},
        )
        latency_ms = 1000.0 * (time.perf_counter() - t0)
        s.requests += 1
        msg = r.choices[0].message
        calls = [c.model_dump() for c in msg.tool_calls or []]
        text = msg.content or ""
        status = "valid" if calls else ("invalid" if "<tool_call>" in text else "none")
        edited = classify(text, calls, status) == "edit"
        ok = edited and passes(task, extract_code(text, calls), sandbox=self.sandbox)
        s.edits += edited
        s.passed += ok
        events: list[dict[str, Any]] = [{"type": "latency_ms", "value": latency_ms}]
        if status == "invalid":
            s.broken_calls += 1
            events.append({"type": "tool_error", "message": "could not parse the tool call"})
        if edited:
            events.append({"type": "accepted" if ok else "rejected"})
            events.append(
                {"type": "edit_persisted", "fraction": 1.0 if ok else 0.0, "after_minutes": 30}
            )
        events.append({"type": "follow_up", "sentiment": "satisfied" if ok else "dissatisfied"})
        self._send(r.id, events)

    def _send(self, interaction_id: str, events: list[dict[str, Any]]) -> None:
        rng, s = self._rng, self.stats
        if rng.random() < self.cfg.drop_rate:
            s.dropped += 1
            return
        batch = [
            {
                "event_id": uuid.uuid4().hex,
                "interaction_id": interaction_id,
                "occurred_at": time.time(),
                **e,
            }
            for e in events
        ]
        batch += [e for e in batch if rng.random() < self.cfg.duplicate_rate]
        s.duplicates_sent += len(batch) - len(events)
        if rng.random() < self.cfg.malformed_rate:
            batch.append(
                {
                    "event_id": uuid.uuid4().hex,
                    "interaction_id": interaction_id,
                    "type": "edit_persisted",
                    "fraction": 7,
                }
            )
            s.malformed_sent += 1
        post_json(self.base_url + "/feedback", {"events": batch})
        s.events_sent += len(batch)


@dataclass
class EvalResult:
    """Per-task scores (paired across policies by task order) and behaviour metrics."""

    scores: dict[str, list[float]]
    behaviour: dict[str, float]
    task_ids: list[str]


class Evaluator(Protocol):
    def __call__(self, policy: Any) -> EvalResult: ...


class HeldoutEvaluator:
    """Samples every held-out task ``cfg.samples`` times with fixed seeds (the same for every
    policy: common random numbers tighten the paired comparison) and grades them.

    Metrics: ``pass@1`` per task (mean pass over samples); behaviour from the replies (every
    other task offers the ``write_file`` tool, as traffic does).
    """

    def __init__(
        self, cfg: EvalSection, tasks: list[SuiteTask] | None = None, *, sandbox: str = "bwrap"
    ) -> None:
        if tasks is None and cfg.suite != "humaneval":
            raise ValueError(f"unknown eval suite {cfg.suite!r}; valid: ['humaneval']")
        self.cfg, self.sandbox = cfg, check_sandbox(sandbox)
        self.tasks = tasks if tasks is not None else humaneval("heldout", limit=cfg.limit)

    def __call__(self, policy: Any) -> EvalResult:
        cfg = self.cfg
        jobs = [(t, i % 2 == 1) for i, t in enumerate(self.tasks) for _ in range(cfg.samples)]
        prompts = [
            encode(
                policy.tokenizer,
                render(
                    policy.tokenizer,
                    t.messages(),
                    tools=[WRITE_FILE] if tool else None,
                    add_generation_prompt=True,
                ),
            )
            for t, tool in jobs
        ]
        params = SamplingParams(
            temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens, seed=cfg.seed
        )
        outs = policy.generate(prompts, params)
        per_task: dict[str, list[float]] = {t.task_id: [] for t in self.tasks}
        rows, replies = [], []
        for k, ((task, tool), out) in enumerate(zip(jobs, outs, strict=True)):
            text = policy.tokenizer.decode(out.token_ids, skip_special_tokens=True)
            _, calls, status = parse_tool_calls(text, [WRITE_FILE] if tool else None)
            action = classify(text, calls, status)
            replies.append((task, extract_code(text, calls) if action == "edit" else None))
            rows.append(
                {
                    "interaction_id": str(k),
                    "action": action,
                    "tool_call_status": status,
                    "completion_token_ids": out.token_ids,
                    "server_latency_ms": 0.0,
                }
            )
        for (task, _), ok in zip(
            replies, grade_replies(replies, sandbox=self.sandbox), strict=True
        ):
            per_task[task.task_id].append(float(ok))
        scores = [sum(v) / len(v) for v in per_task.values()]
        return EvalResult({"pass@1": scores}, behaviour_metrics(rows, {}, {}), list(per_task))
