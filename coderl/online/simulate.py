"""A simulated client population on real HumanEval tasks (the held-out evaluator is
:mod:`coderl.online.heldout`).

The population exists to exercise the machinery end to end (serve -> events -> rewards ->
update -> gate), not to claim that simulated users teach the model. Each client calls
``coderl serve`` through the official ``openai`` client; an edit "persists" iff the hidden tests
pass, and the follow-up is dissatisfied iff the episode failed (no passing edit). Some outcome
events are dropped (censoring), sent twice (idempotency), or accompanied by a malformed event
(rejection), at configurable rates; a broken tool call produces a ``tool_error`` event.

With ``simulate.agent`` every interaction is a whole agent episode instead of one request: the
production harness runs on the client side (:mod:`coderl.online.agent_client`: the harness's
tools, schemas, call format, parsing and self-summarization, the tools executed in a sandbox the
client holds: the task's rollout sandbox, ``coderl.grading.grade.rollout_sandbox``) and the
server generates every turn. The episode's diff is graded as training grades it
(:func:`coderl.online.suites.resolves`: ``coderl.grading.grade.grade``), and a population's house
style is checked on the files it leaves; the outcome events name the episode's last turn and
every turn (summaries included) shares them.

Every reply and episode is graded by training's grader as it arrives (see
:mod:`coderl.online.suites`). Tool schemas, prompts and call parsing are the harness's
(:mod:`coderl.endpoint.calls`): the population offers the harness's ``write_file``.
"""

from __future__ import annotations

import json
import random
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from typing import Any

from coderl.agent.episode import EpisodeConfig
from coderl.agent.tools import TOOLS
from coderl.config.online import PopulationConfig, SimulateConfig, check_sandbox
from coderl.online.server import classify
from coderl.online.suites import (
    SuiteTask,
    diff_keeps_house_style,
    extract_code,
    humaneval,
    passes,
    population_suite,
    resolves,
)

WRITE_FILE = TOOLS["write_file"].schema
"""The harness's ``write_file`` schema: what simulated users offer."""


@dataclass
class SimStats:
    requests: int = 0
    edits: int = 0
    passed: int = 0
    broken_calls: int = 0
    """``tool_error`` events sent: requests (or agent episodes) whose call the client could not
    use. Not the monitors' ``broken_call_rate``, which counts interactions the server stored as
    ``invalid`` too, over the version's trailing window."""
    events_sent: int = 0
    duplicates_sent: int = 0
    malformed_sent: int = 0
    dropped: int = 0
    episodes: int = 0
    """Agent episodes (``simulate.agent``); ``requests`` counts their turns."""
    summaries: int = 0
    """Self-summary turns among ``requests``."""
    harness_errors: int = 0
    """Agent episodes the harness could not start (no request sent, nothing recorded)."""

    def line(self) -> str:
        """The counts as one readable line (what ``coderl online run`` prints after each
        cycle's traffic); the agent-mode counts only where agent episodes ran or failed."""
        agent = [f"{self.episodes} agent episodes"] if self.episodes or self.harness_errors else []
        if self.summaries:
            agent.append(f"{self.summaries} self-summary turns")
        if self.harness_errors:
            agent.append(f"{self.harness_errors} could not start")
        return ", ".join(
            [
                *agent,
                f"{self.requests} requests",
                f"{self.edits} edits ({self.passed} passed)",
                # not the monitors' broken_call_rate, which also counts the calls the server
                # stored as invalid: these are the clients' reports only
                f"{self.broken_calls} tool_error events (calls the clients could not use)",
                f"{self.events_sent} events sent ({self.duplicates_sent} duplicates, "
                f"{self.malformed_sent} malformed)",
                f"feedback of {self.dropped} interactions dropped (online.simulate.drop_rate)",
            ]
        )


def post_json(url: str, body: Any) -> tuple[int, dict[str, Any]]:
    """POST JSON; ``(status, decoded body)`` (HTTP errors are returned, not raised)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def outcome_events(edited: bool, passed: bool) -> list[dict[str, Any]]:
    """A simulated user's outcome events: an edit is accepted and persists iff the hidden tests
    pass; the follow-up is dissatisfied iff the episode failed."""
    events: list[dict[str, Any]] = []
    if edited:
        events.append({"type": "accepted" if passed else "rejected"})
        events.append(
            {"type": "edit_persisted", "fraction": 1.0 if passed else 0.0, "after_minutes": 30}
        )
    events.append({"type": "follow_up", "sentiment": "satisfied" if passed else "dissatisfied"})
    return events


@dataclass
class SimulatedPopulation:
    """Clients that call ``base_url`` (an OpenAI-compatible ``.../v1``) with traffic tasks."""

    base_url: str
    cfg: SimulateConfig
    model: str = "coderl"
    tasks: list[SuiteTask] = field(default_factory=lambda: humaneval("train"))
    sandbox: str = "bwrap"
    """``online.sandbox``: only ``bwrap`` (the graders' sandbox) is valid; ``local`` is refused."""
    stats: SimStats = field(default_factory=SimStats)
    tokenizer: Any = None
    """The served model's tokenizer; the client-side harness renders with it (agent mode)."""
    episode: EpisodeConfig | None = None
    """The harness settings of agent episodes, in the served call format (agent mode)."""

    last_error: str | None = None
    """Traceback of the last episode the harness could not start."""
    populations: list[PopulationConfig] = field(default_factory=list)
    """The configured organisations (``online.populations``): a client of one draws its tasks
    from that population's ``task_filter`` and keeps its ``house_style``: an edit that breaks
    the style is reverted (``edit_persisted`` 0, rejected) even when its tests pass, so the
    populations' outcome events differ in a way an own adapter can learn."""

    def __post_init__(self) -> None:
        if self.cfg.agent and (self.tokenizer is None or self.episode is None):
            raise ValueError("simulate.agent needs the served tokenizer and an EpisodeConfig")
        check_sandbox(self.sandbox)
        from openai import OpenAI

        self._client = OpenAI(base_url=self.base_url, api_key="simulated")
        self._rng = random.Random(self.cfg.seed)
        self._suites: dict[str, list[SuiteTask]] = {}

    def run(self, n: int) -> SimStats:
        """Send ``n`` requests (agent mode: ``n`` episodes) and their outcome events; returns
        the cumulative stats."""
        for _ in range(n):
            self._episode() if self.cfg.agent else self._one()
        return self.stats

    def _population(self) -> str:
        return f"org-{self._rng.randrange(self.cfg.clients) % self.cfg.populations}"

    def _draw(self) -> tuple[str, SuiteTask]:
        """A client's population and a task of its traffic (the population's suite of
        ``tasks`` when it is configured, else any of ``tasks``)."""
        population = self._population()
        pop = next((p for p in self.populations if p.name == population), None)
        if pop is None:
            return population, self._rng.choice(self.tasks)
        if population not in self._suites:
            self._suites[population] = population_suite(
                "train", task_filter=pop.task_filter, house_style=pop.house_style, tasks=self.tasks
            )
        return population, self._rng.choice(self._suites[population])

    def _episode(self) -> None:
        """One agent episode through the client-side harness, graded, then its events."""
        from coderl.grading.grade import rollout_sandbox
        from coderl.online.agent_client import run_served_episode

        rng, s = self._rng, self.stats
        assert self.episode is not None
        population, suite_task = self._draw()
        task = suite_task.task
        sandbox = rollout_sandbox(task)
        try:
            served = run_served_episode(
                self._client,
                self.tokenizer,
                task,
                sandbox,
                self.episode,
                model=self.model,
                episode_id=f"ep-{uuid.uuid4().hex}",
                population=population,
                seed=rng.randrange(2**31),
            )
        finally:
            sandbox.close()
        ep = served.episode
        if not served.turns:  # the harness failed before its first request: infrastructure
            s.harness_errors += 1
            self.last_error = ep.error
            return
        s.episodes += 1
        s.requests += len(served.turns)
        s.summaries += sum(t.summary for t in served.turns)
        # an edit is a change to the workspace, or, as for single requests, a code block the
        # server classified as an edit (the user may paste it): the client and the reward agree
        code = None
        if not ep.diff.strip():
            blocks = [t.text for t in served.turns if classify(t.text, [], "none") == "edit"]
            code = extract_code(blocks[-1]) if blocks else None
        edited = bool(ep.diff.strip()) or code is not None
        if ep.diff.strip():
            ok = resolves(suite_task, ep.diff)
            ok = ok and diff_keeps_house_style(task, ep.diff, suite_task.style)
        else:
            ok = passes(suite_task, code)
        s.edits += edited
        s.passed += ok
        last = served.turns[-1].interaction_id
        events: list[dict[str, Any]] = [
            {"interaction_id": t.interaction_id, "occurred_at": t.finished_at,
             "type": "latency_ms", "value": t.latency_ms}
            for t in served.turns
        ]  # fmt: skip
        if ep.stats.broken_tool_calls:
            s.broken_calls += 1
            events.append({"interaction_id": last, "type": "tool_error", "message": "broken call"})
        events += [{"interaction_id": last, **e} for e in outcome_events(edited, ok)]
        self._send(events)

    def _one(self) -> None:
        rng, s = self._rng, self.stats
        population, task = self._draw()
        tools = [WRITE_FILE] if rng.random() < self.cfg.tool_share else None
        t0 = time.perf_counter()
        r = self._client.chat.completions.create(
            model=self.model,
            messages=task.messages(),  # type: ignore[arg-type]
            tools=tools,  # type: ignore[arg-type]
            seed=rng.randrange(2**31),
            extra_body={"population": population},
        )
        latency_ms = 1000.0 * (time.perf_counter() - t0)
        s.requests += 1
        msg = r.choices[0].message
        calls = [c.model_dump() for c in msg.tool_calls or []]
        text = msg.content or ""
        status = "valid" if calls else ("invalid" if "<tool_call>" in text else "none")
        edited = classify(text, calls, status) == "edit"
        ok = edited and passes(task, extract_code(text, calls))
        s.edits += edited
        s.passed += ok
        events: list[dict[str, Any]] = [{"type": "latency_ms", "value": latency_ms}]
        if status == "invalid":
            s.broken_calls += 1
            events.append({"type": "tool_error", "message": "could not parse the tool call"})
        events += outcome_events(edited, ok)
        self._send([{"interaction_id": r.id, **e} for e in events])

    def _send(self, events: list[dict[str, Any]]) -> None:
        """Post one interaction's (or episode's) events, each naming its ``interaction_id``;
        dropped, duplicated and joined by a malformed event at the configured rates."""
        rng, s = self._rng, self.stats
        if rng.random() < self.cfg.drop_rate:
            s.dropped += 1
            return
        interaction_id = events[-1]["interaction_id"]
        batch = [{"event_id": uuid.uuid4().hex, "occurred_at": time.time(), **e} for e in events]
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
