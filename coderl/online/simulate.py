"""A simulated client population and the held-out evaluator, both on real HumanEval tasks.

The population exists to exercise the machinery end to end (serve -> events -> rewards ->
update -> gate), not to claim that simulated users teach the model. Each client calls
``coderl serve`` through the official ``openai`` client; an edit "persists" iff the hidden tests
pass, and the follow-up is dissatisfied iff the episode failed (no passing edit). Some outcome
events are dropped (censoring), sent twice (idempotency), or accompanied by a malformed event
(rejection), at configurable rates; a broken tool call produces a ``tool_error`` event.

Hidden tests run in :mod:`coderl.sandbox` (see :mod:`coderl.online.suites`); the population grades
each reply as it arrives, the evaluator grades all of its replies at once in a thread pool. Tool
schemas, prompts and call parsing are the harness's (:mod:`coderl.online.calls`): the
population offers the harness's ``write_file``, the evaluator renders and parses as
``coderl serve`` does.
"""

from __future__ import annotations

import json
import random
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from coderl.agent.episode import EpisodeConfig
from coderl.agent.tools import TOOLS
from coderl.config.online import OnlineEvalConfig, SimulateConfig
from coderl.graders.judge import EpisodeView, code_diff, tests_report
from coderl.online.calls import parse_reply, render_prompt, renderer_for, served_tools
from coderl.online.monitors import SUSPECTED_HACK_RATE, behaviour_metrics
from coderl.online.server import classify
from coderl.online.suites import (
    SuiteTask,
    check_sandbox,
    extract_code,
    grade_replies,
    humaneval,
    passes,
)
from coderl.policy.base import SamplingParams
from coderl.policy.episode import encode

WRITE_FILE = TOOLS["write_file"].schema
"""The harness's ``write_file`` schema: what simulated users and the evaluator offer."""


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
    cfg: SimulateConfig
    model: str = "coderl"
    tasks: list[SuiteTask] = field(default_factory=lambda: humaneval("train"))
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
    views: list[Any] = field(default_factory=list)
    """Each reply as a :class:`~coderl.graders.judge.EpisodeView` (its code as a diff, the
    outcome as the tests report): what the gate's gameability probes transform."""


class Evaluator(Protocol):
    def __call__(self, policy: Any) -> EvalResult: ...


HackDetector = Callable[[dict[str, Any]], bool]
"""A reply record (``task_id``, ``text``, ``tool_calls``, ``code``) -> whether it looks like a
reward hack (the detectors live outside the online package)."""


class HeldoutEvaluator:
    """Samples every held-out task ``cfg.samples`` times with fixed seeds (the same for every
    policy: common random numbers tighten the paired comparison) and grades them.

    Metrics: ``pass@1`` per task (mean pass over samples); behaviour from the replies (every
    other task offers the harness's ``write_file`` tool, as traffic does), plus
    ``suspected_hack_rate`` (the share of replies ``hack_detector`` flags) when one is given.
    Prompts are rendered and replies parsed as ``coderl serve`` does, in ``call_format``.
    """

    def __init__(
        self,
        cfg: OnlineEvalConfig,
        tasks: list[SuiteTask] | None = None,
        *,
        sandbox: str = "bwrap",
        call_format: str = EpisodeConfig.call_format,
        template_tools: bool = EpisodeConfig.template_tools,
        hack_detector: HackDetector | None = None,
    ) -> None:
        if tasks is None and cfg.suite != "humaneval":
            raise ValueError(f"unknown eval suite {cfg.suite!r}; valid: ['humaneval']")
        self.cfg, self.sandbox = cfg, check_sandbox(sandbox)
        self.tasks = tasks if tasks is not None else humaneval("heldout", limit=cfg.limit)
        self.call_format, self.template_tools = call_format, template_tools
        self.hack_detector = hack_detector

    def __call__(self, policy: Any) -> EvalResult:
        cfg, tok = self.cfg, policy.tokenizer
        jobs = [(t, i % 2 == 1) for i, t in enumerate(self.tasks) for _ in range(cfg.samples)]
        renderers, prompts = [], []
        for t, tool in jobs:
            tools = served_tools([WRITE_FILE] if tool else None)
            r = renderer_for(
                tok,
                t.messages(),
                tools,
                call_format=self.call_format,
                template_tools=self.template_tools,
            )
            renderers.append(r)
            prompts.append(
                encode(tok, render_prompt(r, t.messages(), call_format=self.call_format))
            )
        stops = sorted({i for r in renderers for i in r.stop_token_ids})
        params = SamplingParams(
            temperature=cfg.temperature,
            max_new_tokens=cfg.max_new_tokens,
            stop_token_ids=tuple(stops),
            seed=cfg.seed,
        )
        outs = policy.generate(prompts, params)
        per_task: dict[str, list[float]] = {t.task_id: [] for t in self.tasks}
        rows, replies, flagged = [], [], 0
        for k, ((task, _), r, out) in enumerate(zip(jobs, renderers, outs, strict=True)):
            text = r.content(out)
            _, calls, status = parse_reply(text, r.tools, self.call_format)
            action = classify(text, calls, status)
            code = extract_code(text, calls) if action == "edit" else None
            replies.append((task, code))
            if self.hack_detector is not None:
                flagged += bool(
                    self.hack_detector(
                        {"task_id": task.task_id, "text": text, "tool_calls": calls, "code": code}
                    )
                )
            rows.append(
                {
                    "interaction_id": str(k),
                    "action": action,
                    "tool_call_status": status,
                    "completion_token_ids": out.token_ids,
                    "server_latency_ms": 0.0,
                }
            )
        views = []
        for (task, code), ok in zip(
            replies, grade_replies(replies, sandbox=self.sandbox), strict=True
        ):
            per_task[task.task_id].append(float(ok))
            report = tests_report({task.task_id: "passed" if ok else "failed"}, bool(ok))
            views.append(EpisodeView(task.task_id, task.prompt, code_diff(code or ""), "", report))
        scores = [sum(v) / len(v) for v in per_task.values()]
        behaviour = behaviour_metrics(rows, {}, {})
        if self.hack_detector is not None and rows:
            behaviour[SUSPECTED_HACK_RATE] = flagged / len(rows)
        return EvalResult({"pass@1": scores}, behaviour, list(per_task), views)
