"""``coderl serve``: an OpenAI-compatible chat-completions endpoint that records what it served.

Endpoints (FastAPI):

- ``POST /v1/chat/completions``: OpenAI request format with ``tools`` and ``logprobs``. Per request
  it records the exact prompt and completion token ids, the per-token behaviour logprobs, the
  sampling settings and the policy version, and returns the interaction id (the response ``id``,
  an ``interaction_id`` field and the ``X-Interaction-Id`` header). Sampling is stochastic by
  default (``default_temperature`` > 0): a greedy policy logs nothing to learn from. Extra body
  fields ``episode_id``, ``population`` and ``is_summary`` group turns into episodes and clients
  into populations. The population picks the weights (:mod:`coderl.online.routing`): its own
  adapter once it has an own champion, else the shared one; the adapter served is recorded with
  every interaction and returned as ``adapter``. A configurable share of requests that set no
  temperature is sampled for exploration at a higher temperature (``online.exploration``),
  recorded with ``exploration = true`` and the logprobs of that tempered distribution.
  ``return_token_ids`` returns the sampled and prompt token ids.
- ``POST /v1/feedback``: one outcome event, a list, or ``{"events": [...]}`` (see
  :mod:`coderl.online.events`). Malformed events are rejected with a reason (HTTP 400 listing
  them; the valid ones in the same request are still stored) and counted; duplicates are stored
  once.
- ``GET /v1/models``, ``GET /v1/models/{id}`` (a served name, else 404), ``GET /v1/stats`` (ingestion counters), ``POST /v1/admin/reload``
  (load every champion of the registry that changed: the shared one and each population's).

- ``GET /v1/tools``: the harness tools a request may offer, with their schemas, and the call
  format.

Tools, prompts and tool calls are the agent harness's (:mod:`coderl.endpoint.calls`): the request's
``tools`` name harness tools, the conversation is rendered as the harness renders it, and the
reply is parsed in the configured call format (``online.serve.call_format``; by default the run's
harness format) and validated by the harness's own rule, so a served call is valid iff the
harness would execute it. A reply with an invalid call carries the raw text and no
``tool_calls``, and the interaction is stored with ``tool_call_status = "invalid"`` (a negative
example downstream).

Concurrency: requests are answered concurrently, each in its own thread. A vLLM engine gets
them as they come and batches them itself; the in-process sampler gets them through
:class:`coderl.endpoint.batching.WindowBatcher` (each ``generate`` call carries every request that
is waiting when it starts, and waits up to ``batch_window_s`` for the others the server holds). Each interaction records its own sampled ids and logprobs. A reload
waits for the requests in flight and holds new ones back while routes change (a reader/writer
gate, :class:`_Gate`), so no request samples an adapter while it is replaced.

Errors: every error, an unknown path (404) and a wrong method (405) included, has OpenAI's
shape ``{"error": {"message", "type", "param", "code"}}`` (:mod:`coderl.endpoint.errors`). What
is the client's answers 4xx with a reason (bad JSON or fields, a role other than OpenAI's: 400; a tool that is
not the harness's: 400; a conversation that cannot be rendered: 400; a prompt that fills the
engine's context: 400). An engine failure answers 503 with its reason and the server keeps
serving.

Requests, streaming, ``stop``: :mod:`coderl.endpoint.chat` (the one request path of ``coderl
serve`` and the gateway); what is honoured, accepted at a neutral value or refused:
:mod:`coderl.endpoint.request`. The request's ``model`` does not select weights
(the population does): it must be a served name (``model.name``, or the alias ``coderl``;
``GET /v1/models`` lists them), and any other is answered 404 ``NotFoundError`` as vLLM
answers it; the reply's ``model`` is the name asked for. No authentication: bind to localhost or put it behind a proxy.
"""

from __future__ import annotations

import ast
import json
import logging
import random
import re
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.responses import JSONResponse

from coderl.agent.episode import EpisodeConfig
from coderl.agent.parsing import get_call_format
from coderl.agent.tools import TOOLS
from coderl.config.online import SHARED, ExplorationConfig
from coderl.endpoint.batching import EngineError, WindowBatcher, generate_one
from coderl.endpoint.calls import RequestError, served_tools
from coderl.endpoint.chat import ChatRequest, chat_endpoint, response_body, sample_chat
from coderl.endpoint.continuation import Turn
from coderl.endpoint.errors import ApiError, install_error_handlers
from coderl.grading.pyparse import parse_python
from coderl.online.events import MAX_REQUEST_BYTES, Rejected, parse_event, parse_json
from coderl.online.routing import Route, Router
from coderl.online.store import Store, interaction_row
from coderl.policy.base import SamplingParams, context_limit
from coderl.policy.local import LocalPolicy
from coderl.policy.rollout import TorchRollout

log = logging.getLogger("coderl.online")

MAX_OPEN_EPISODES = 4096
"""Episodes whose last call the server keeps for token-exact continuation (oldest dropped)."""
EDIT_TOOLS = ("edit", "write_file", "apply_patch", "str_replace", "replace", "create_file")
_FENCE = re.compile(r"```[^\n]*\n(.*?)```", re.S)  # the body of each fenced block


class _Gate:
    """Readers/writer gate: requests share it, a reload has it alone (waits for the requests in
    flight; requests arriving meanwhile wait for the reload)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writing = False

    def __enter__(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: not self._writing)
            self._readers += 1

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._readers -= 1
            self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._writing)
            self._writing = True
            self._cond.wait_for(lambda: self._readers == 0)
        try:
            yield
        finally:
            with self._cond:
                self._writing = False
                self._cond.notify_all()


def in_process(sampler: Any) -> bool:
    """Whether ``sampler`` runs the model in this process (batched by the server's
    :class:`~coderl.endpoint.batching.WindowBatcher`) rather than in an engine that batches
    concurrent requests itself (vLLM)."""
    return isinstance(sampler, (LocalPolicy, TorchRollout))


def classify(text: str, calls: list[dict[str, Any]], status: str) -> str:
    """The turn's action, from what it did: ``edit`` (a valid edit tool call that carries
    content, or a fenced block with at least one line of code), ``tool`` (other valid calls),
    ``clarify`` (no edit, ends with a question mark) or ``none``.

    An edit that does nothing (an empty or blank fence, a fence of comments only or of no-op
    Python: ``pass``, ``...``, a bare literal or name; an edit call whose written text is empty,
    a no-op, or the text it replaces) is not an edit: it would make an episode a censored "edit"
    (no outcome events ever come for it) and so dodge the deferral reward."""
    if status != "invalid" and any(_edits(c) for c in calls):
        return "edit"
    if any(_is_code(body) for body in _FENCE.findall(text)):
        return "edit"
    if calls:
        return "tool"
    if text.strip().endswith("?") and status != "invalid":
        return "clarify"
    return "none"


_WHERE = re.compile(r"path|file|name|dir", re.I)
"""Edit-call argument names that say where to write, not what."""


def _edits(call: dict[str, Any]) -> bool:
    """An edit tool call whose arguments write some code (:func:`_is_code`) that differs from
    every text it replaces (arguments named ``old...``); arguments that name a place
    (:data:`_WHERE`) write nothing."""
    if call["function"]["name"] not in EDIT_TOOLS:
        return False
    try:
        args = json.loads(call["function"].get("arguments") or "{}")
    except ValueError:
        return False
    if not isinstance(args, dict):
        return isinstance(args, str) and _is_code(args)
    what = {k: v for k, v in args.items() if isinstance(v, str) and not _WHERE.search(k)}
    old = {v for k, v in what.items() if k.lower().startswith("old")}
    return any(
        _is_code(v) and v not in old for k, v in what.items() if not k.lower().startswith("old")
    )


_COMMENT = re.compile(r"^\s*(#|//|--|/\*|<!--)")


def _is_code(body: str) -> bool:
    """Some line that is neither blank nor a comment, and, where the body parses as Python,
    some statement other than a no-op (``pass``, ``...``, a bare literal or name). A body
    Python does not parse (another language) is judged by its lines alone."""
    if not any(line.strip() and not _COMMENT.match(line) for line in body.splitlines()):
        return False
    try:
        tree = parse_python(body)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return True
    return any(not _no_op(stmt) for stmt in tree.body)


def _no_op(stmt: ast.stmt) -> bool:
    if isinstance(stmt, ast.Pass):
        return True
    return isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant | ast.Name)


class InteractionServer:
    """Serves a policy and records every interaction into ``store``.

    Args:
        policy: what samples: a rollout engine (:func:`coderl.policy.rollout.build_engine`:
            the in-process sampler or a vLLM server) or a
            :class:`coderl.policy.local.LocalPolicy`; it needs a tokenizer with a chat template
            and ``generate`` with exact logprobs.
        store: where interactions and events go.
        version: the registry version of the served weights (recorded per interaction).
        model_name: the served model name (``coderl serve``: ``model.name``), the first one
            ``GET /v1/models`` lists.
        aliases: other names a request's ``model`` may give; any other name is answered 404
            (``NotFoundError``), as vLLM answers a name it does not serve.
        default_temperature: used when a request sets none (> 0: stochastic by default).
        max_new_tokens: default and upper bound of generated tokens per request.
        call_format: the harness's tool-call format the model was trained in (a key of
            ``coderl.agent.CALL_FORMATS``; default the harness's default).
        template_tools: as ``EpisodeConfig.template_tools``: let a chat template that renders
            ``tools=`` show them (else the system prompt carries the format's tool section).
        reload: given the served version, returns ``(policy, version)`` of the registry's
            champion, or None when it is the served one (for ``/v1/admin/reload``); None
            disables the endpoint (unless ``refresh`` is given).
        router: population -> weights (default: every population on ``policy``, the shared
            route at ``version``).
        refresh: brings ``router`` to the registry's champions (for ``/v1/admin/reload``,
            instead of ``reload``), returning the populations whose route changed.
        exploration: the share of requests sampled at the exploration temperature (None: no
            exploration).
        batch_window_s: the longest an in-process sampler's batch waits, before it starts, for
            requests this server holds (:class:`coderl.endpoint.batching.WindowBatcher`; 0:
            never waits).
    """

    def __init__(
        self,
        policy: Any,
        store: Store,
        *,
        version: int,
        model_name: str = "coderl",
        aliases: Sequence[str] = ("coderl",),
        default_temperature: float = 0.8,
        max_new_tokens: int = 256,
        reload: Callable[[int], tuple[Any, int] | None] | None = None,
        clock: Callable[[], float] = time.time,
        call_format: str = EpisodeConfig.call_format,
        template_tools: bool = EpisodeConfig.template_tools,
        router: Router | None = None,
        refresh: Callable[[Router], list[str]] | None = None,
        exploration: ExplorationConfig | None = None,
        batch_window_s: float = 0.05,
    ) -> None:
        if default_temperature <= 0:
            raise ValueError("default_temperature must be > 0: greedy traffic teaches nothing")
        get_call_format(call_format)  # KeyError listing the valid ones
        self.call_format, self.template_tools = call_format, template_tools
        self.router = router or Router(Route(policy, version))
        self.store = store
        self.model_name = model_name
        self.model_names = (model_name, *(a for a in aliases if a != model_name))
        self.default_temperature = default_temperature
        self.max_new_tokens = max_new_tokens
        self._reload, self._refresh, self._clock = reload, refresh, clock
        self._lock = threading.Lock()  # the exploration draws
        self._gate = _Gate()
        self.batcher = WindowBatcher(batch_window_s)
        self.exploration = exploration or ExplorationConfig()
        if self.exploration.share > 0 and self.exploration.temperature == default_temperature:
            raise ValueError("the exploration temperature equals the serving temperature")
        self._explore_rng = random.Random(self.exploration.seed)
        self._turns: OrderedDict[str, Turn] = OrderedDict()  # episode id -> its last call

    @property
    def policy(self) -> Any:
        """The shared route's sampler."""
        return self.router.route(SHARED).sampler

    @property
    def version(self) -> int:
        """The shared route's registry version."""
        return self.router.route(SHARED).version

    def swap(self, policy: Any, version: int, population: str = SHARED) -> None:
        """Serve new weights to ``population`` (default: the shared route) from the next
        request on."""
        self.router.set(Route(policy, version, population))

    def reload_routes(self) -> list[str]:
        """Pick up newly promoted champions (``refresh``, else ``reload`` of the shared
        route); returns the populations whose route changed. Waits for the reply being
        generated, so no request samples an adapter while it is replaced."""
        with self._gate.exclusive():
            if self._refresh is not None:
                return self._refresh(self.router)
            new = self._reload(self.version) if self._reload is not None else None
            if new is None:
                return []
            self.router.set(Route(*new))
            return [SHARED]

    def _sampling(self, req: ChatRequest) -> tuple[float, bool]:
        """``(temperature, exploration)``: a request's own temperature is honoured and never
        explored; otherwise a draw of the server's seeded generator decides exploration."""
        if req.temperature is not None:
            return req.temperature, False
        with self._lock:
            explore = self._explore_rng.random() < self.exploration.share
        return (self.exploration.temperature if explore else self.default_temperature), explore

    def check_model(self, name: str) -> None:
        """Raises ``ApiError(404)`` (``NotFoundError``, ``param`` ``model``) unless ``name`` is a
        served name (:attr:`model_names`), as vLLM answers a name it does not serve."""
        if name not in self.model_names:
            served = ", ".join(self.model_names)
            raise ApiError(
                404, f"The model `{name}` does not exist (served: {served}).", param="model"
            )

    def complete(self, req: ChatRequest) -> dict[str, Any]:
        """Generate one reply, record it, return the OpenAI response body.

        Raises:
            HTTPException(404): ``model`` is not a served name (:attr:`model_names`).
            HTTPException(400): a tool that is not the harness's, the conversation cannot be
                rendered, or its prompt fills the engine's context.
            HTTPException(503): the engine failed (logged; the server keeps serving).
        """
        self.check_model(req.model)
        with self.batcher.incoming():  # a batch about to start knows this request is coming
            return self._complete(req)

    def _complete(self, req: ChatRequest) -> dict[str, Any]:
        temperature, explore = self._sampling(req)
        population = req.population or req.user or "default"
        start = time.perf_counter()
        try:
            tools = served_tools(req.tools)
            with self._gate:  # a reload waits for this reply: no adapter is replaced mid-request
                route = self.router.route(population)
                policy, version = route.sampler, route.version
                s = sample_chat(
                    req,
                    policy.tokenizer,
                    tools,
                    lambda prompt, params: self._generate(policy, prompt, params),
                    temperature=temperature,
                    max_new_tokens=self.max_new_tokens,
                    context=context_limit(policy),
                    call_format=self.call_format,
                    template_tools=self.template_tools,
                    previous=self._last_turn(req.episode_id, population, version),
                )
        except RequestError as e:
            raise ApiError(400, str(e), param=e.param) from None
        self._keep_turn(req.episode_id, population, version, s.turn)
        latency_ms = 1000.0 * (time.perf_counter() - start)
        out, params = s.completion, s.params
        iid = f"chatcmpl-{uuid.uuid4().hex}"
        self.store.record_interaction(
            interaction_row(
                iid,
                policy_version=version,
                created_at=self._clock(),
                prompt_token_ids=s.prompt_ids,
                completion_token_ids=out.token_ids,
                behaviour_logprobs=out.logprobs,
                temperature=temperature,
                episode_id=req.episode_id,
                population=population,
                adapter=route.adapter,
                exploration=explore,
                action=classify(s.text, s.calls, s.status),
                tool_call_status=s.status,
                top_p=params.top_p,
                max_new_tokens=params.max_new_tokens,
                seed=req.seed,
                finish_reason=out.finish_reason,
                is_summary=req.is_summary,
                server_latency_ms=latency_ms,
                request=req.model_dump(exclude_none=True),
                response_text=s.text,
            )
        )
        body = response_body(
            iid,
            req.model,  # the served name or alias asked for, as vLLM answers
            int(self._clock()),
            s,
            policy.tokenizer,
            logprobs=bool(req.logprobs),
        )
        body |= {
            "system_fingerprint": f"coderl-v{version}",
            "interaction_id": iid,
            "policy_version": version,
            "adapter": route.adapter,
        }
        if req.return_token_ids:
            body["prompt_token_ids"] = list(s.prompt_ids)
            body["choices"][0]["token_ids"] = list(out.token_ids)
        return body

    def _last_turn(self, episode_id: str | None, population: str, version: int) -> Turn | None:
        """The episode's last call on the same weights, which this one may continue token for
        token (:mod:`coderl.endpoint.continuation`); None without an episode id."""
        if episode_id is None:
            return None
        with self._lock:
            return self._turns.get(f"{population}\0{version}\0{episode_id}")

    def _keep_turn(self, episode_id: str | None, population: str, version: int, turn: Turn) -> None:
        if episode_id is None:
            return
        key = f"{population}\0{version}\0{episode_id}"
        with self._lock:
            self._turns[key] = turn
            self._turns.move_to_end(key)
            while len(self._turns) > MAX_OPEN_EPISODES:
                self._turns.popitem(last=False)

    def _generate(self, sampler: Any, prompt: list[int], params: SamplingParams) -> Any:
        """One completion, batched for an in-process sampler, straight to an engine that
        batches itself.

        Raises:
            HTTPException(503): the engine failed.
        """
        try:
            return generate_one(
                sampler, prompt, params, self.batcher if in_process(sampler) else None
            )
        except EngineError as e:
            log.exception("engine failure")
            raise HTTPException(503, str(e)) from None

    def feedback(self, body: bytes) -> tuple[int, dict[str, Any]]:
        """Ingest the events in a request body; ``(http_status, result)``.

        The body is one event, a list, or ``{"events": [...]}``. Each event is held to the
        same limits as an imported line (:func:`coderl.online.events.parse_event`: size,
        nesting depth, strict finite numbers). A body over ``MAX_REQUEST_BYTES`` answers 413,
        one that is not JSON or nested too deeply 400; both are counted as rejected.
        """
        if len(body) > MAX_REQUEST_BYTES:
            reason = f"too_large: request body {len(body)} bytes > {MAX_REQUEST_BYTES}"
            res = self.store.ingest([Rejected(reason, "")])
            return 413, {"stored": 0, "duplicates": 0, "rejected": res.reasons}
        obj = parse_json(body)
        if isinstance(obj, Rejected):
            res = self.store.ingest([obj])
            return 400, {"stored": 0, "duplicates": 0, "rejected": res.reasons}
        items = obj.get("events", [obj]) if isinstance(obj, dict) else obj
        if not isinstance(items, list):
            items = [items]
        res = self.store.ingest([parse_event(x) for x in items])
        out = {"stored": res.stored, "duplicates": res.duplicates, "rejected": res.reasons}
        return (400 if res.reasons else 200), out

    def app(self) -> FastAPI:
        app = install_error_handlers(FastAPI(title="coderl serve"))

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            return await chat_endpoint(request, self.complete)

        @app.post("/v1/feedback")
        async def feedback(request: Request) -> JSONResponse:
            status, out = self.feedback(await request.body())
            return JSONResponse(out, status)

        @app.get("/v1/tools")
        def tools() -> dict[str, Any]:
            return {
                "object": "list",
                "call_format": self.call_format,
                "data": [t.schema for t in TOOLS.values()],
            }

        def card(name: str) -> dict[str, Any]:
            return {
                "id": name,
                "object": "model",
                "owned_by": "coderl",
                "created": 0,
                "policy_version": self.version,
            }

        @app.get("/v1/models")
        def models() -> dict[str, Any]:
            return {"object": "list", "data": [card(name) for name in self.model_names]}

        @app.get("/v1/models/{model:path}")
        def model(model: str) -> dict[str, Any]:
            self.check_model(model)
            return card(model)

        @app.get("/v1/stats")
        def stats() -> dict[str, Any]:
            return {
                "policy_version": self.version,
                "interactions": len(self.store.interactions()),
                "events": self.store.event_count(),
                "duplicate_events": self.store.counter("duplicate_events"),
                "rejected_events": self.store.rejected_counts(),
            }

        @app.post("/v1/admin/reload")
        def reload() -> dict[str, Any]:
            if self._refresh is None and self._reload is None:
                raise HTTPException(404, "reload is not configured")
            changed = self.reload_routes()
            adapters = {p: r.adapter for p, r in self.router.routes().items()}
            return {"policy_version": self.version, "adapters": adapters, "changed": changed}

        return app
