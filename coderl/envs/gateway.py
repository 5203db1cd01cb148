"""``gateway``: train any agent program that speaks OpenAI's chat-completions API ("bring your
own harness"; docs/harness-byo.md).

Per episode the environment starts the user's program (``tasks.options.program``, a shell
command) with the task's statement and its own endpoint, and waits for it to end:

- **Model calls**: ``$OPENAI_BASE_URL`` (also ``$OPENAI_API_BASE``) is the episode's
  ``/v1/chat/completions``, behind a secret path (``$OPENAI_API_KEY`` holds the same secret);
  requests are read as ``coderl serve`` reads them (:mod:`coderl.endpoint.request`: content
  parts, ``stop``, streaming, ``tool_choice``, neutral values of the fields coderl does not
  implement; the rest refused with a 400 naming the field, the value and what is supported),
  with the program's own tools shown through the chat template and calls parsed in the model's
  native format (``tasks.options.call_format``). Every call is sampled from the policy being
  trained, batched with the calls of every other episode running (one
  :class:`~coderl.endpoint.batching.WindowBatcher`), and recorded token-exactly: prompt ids as
  the template renders them, sampled ids, behaviour logprobs, policy version. Sampling settings
  are the run's (``rollout.temperature``, ``top_p``, ``max_new_tokens``; seeds per call with
  ``tasks.options.seeded``): a program's ``temperature``, ``top_p`` and ``seed`` are not
  honoured, since the trainer scores the samples under the run's distribution.
- **Commands** run in the episode's own coderl sandbox (the one a native episode gets, workspace
  at ``/testbed``) through ``$CODERL_SANDBOX_URL``; ``$CODERL_EXEC`` is a ``docker``-compatible
  command line for it (:mod:`coderl.envs.sandbox_exec`), also set as
  ``$MSWEA_DOCKER_EXECUTABLE`` so mini-swe-agent's ``docker`` environment uses it.
- **The task**: ``$CODERL_TASK_FILE`` holds the statement (``$CODERL_TASK_ID`` its id);
  ``$CODERL_OUTPUT_DIR`` is the program's own scratch directory (also its cwd and ``$HOME``,
  deleted after the episode); ``$CODERL_LAUNCH_DIR`` is where coderl was started (for the
  program's own files, e.g. its config); ``$CODERL_ROOT`` is the directory that holds the
  ``coderl`` package (the checkout, for a source install: its ``.venv-agents`` and
  ``configs``, wherever coderl was started). A program whose first word is a path that does not
  exist (with these two expanded) is refused before the model loads (:func:`check_program`).

Trajectory: the calls, in order, through :func:`coderl.endpoint.chat.trajectory_of` (the segmenting
of ``coderl serve``'s episodes too). A call that carries the previous call and its reply
unchanged is sampled from the exact ids (:mod:`coderl.endpoint.continuation`) and continues the
segment; any other (the program rewrote, summarised or truncated its history) is rendered whole
and starts a new segment (``episode/segments`` counts them).
The answer is the sandbox's diff, graded by the inner environment's grader
(``tasks.options.inner``: ``fnrepair``, ``humaneval`` or ``repo``) exactly like a native
episode's.

Limits and failures: ``rollout.max_turns`` calls and ``token_budget()`` sampled tokens per
episode (the call that would exceed them is refused and the program stopped: ``max_turns`` /
``max_tokens``, truncated), ``tasks.options.timeout_s`` of the program's own wall time (time
waiting for the model does not count; past it the process group is killed: ``timeout``); an
interrupted rollout (Ctrl-C, SIGTERM: a ``KeyboardInterrupt`` in the thread that called
``rollout``) kills every program's process group at once. A call whose prompt leaves the engine
no room to sample (:func:`coderl.policy.base.context_limit`) is refused (400) before it reaches
the engine and the program stopped: ``context``, scored as the agent's ending like the native
harness's (as the program's first call, nothing sampled reached it: infra, as below, like a
native episode whose first window does not fit). A command the program sends that cannot be one (NUL, a lone surrogate, bad types,
over ``MAX_EXEC_BYTES``) is answered 400 and the episode goes on. A program that exits
non-zero or hangs past its time after calling the model is the agent's failure: scored (its diff
is graded all the same). A program that never called the model (it did not start, or it ended
before its first request) is ``infra``: nothing the policy sampled reached it, so nothing the
policy did caused it (the reason keeps its ending and last output line), and a step or an
evaluation where every episode is so fails loudly instead of scoring 0. The gateway's own
faults (the engine failed, the sandbox would not start, the diff could not be taken) are
``infra`` too: masked and counted.

Not isolated: the program itself runs on the host as the training user (it is the user's own
harness, trusted like coderl); it gets a clean environment (no host variables but ``PATH``,
``LANG``) and an empty scratch directory, never the task's tests, the grader or another
episode's secret, and the policy's commands reach only the sandbox. A program that executes
model output on the host itself defeats that. Not recorded: what a program does between calls
(its own prompts are in the calls); ``n > 1``; ``tool_choice`` ``required``; sampling settings.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException, Request, Response

from coderl.agent.episode import diff_failure
from coderl.config import Config, ConfigError
from coderl.endpoint.batching import EngineError, WindowBatcher, generate_one
from coderl.endpoint.calls import ContextFullError, RequestError
from coderl.endpoint.chat import (
    Call,
    ChatRequest,
    chat_endpoint,
    client_tools,
    response_body,
    sample_chat,
    trajectory_of,
)
from coderl.endpoint.continuation import Turn
from coderl.endpoint.errors import ApiError, install_error_handlers
from coderl.endpoint.http import BackgroundServer
from coderl.envs.agent import AgentEnvironment, sandbox_for
from coderl.envs.base import EpisodeRecord, FailureKind, GradeRecord, SamplingPolicy
from coderl.grading.grade import SETUP_FAULTS
from coderl.policy.base import SamplingParams, context_limit
from coderl.pools import thread_pool
from coderl.progress import warn_masked
from coderl.sandbox.base import DIFF_FAULTS, SandboxError
from coderl.trajectory import Trajectory

log = logging.getLogger(__name__)

EXEC_SHIM = Path(__file__).with_name("sandbox_exec.py")


@dataclass
class GatewayOptions:
    """``tasks.options`` of the ``gateway`` source (besides the inner source's own keys)."""

    program: str
    """Shell command that runs the agent program once (bash, cwd its scratch directory)."""
    inner: str = "fnrepair"
    """The task source whose tasks, sandboxes and grader are used: ``fnrepair``, ``humaneval``
    or ``repo``."""
    timeout_s: float = 600.0
    """Wall time of one program run; past it the program is killed (the agent's failure)."""
    exec_timeout_s: float = 60.0
    """Longest one sandbox command may run."""
    model: str = "policy"
    """The model name the endpoint reports (a program may name any)."""
    call_format: str = "hermes"
    """The model's native tool-call format (a key of ``coderl.agent.CALL_FORMATS``)."""
    template_tools: bool = True
    """Show the program's tools through the chat template when it renders ``tools=``."""
    seeded: bool = False
    """Seed every call from the rollout's seed, the episode and the call's index: a
    deterministic program then replays exactly (a resumed run equals the uninterrupted one),
    but seeded calls are sampled one at a time instead of batched."""


@dataclass
class _Episode:
    """One program run: its task, sandbox, secret, calls and how it ended."""

    index: int
    task: Any
    sandbox: Any
    secret: str
    calls: list[Call] = field(default_factory=list)
    sampled: int = 0
    statuses: list[str] = field(default_factory=list)
    ending: str = ""
    """Why the gateway stopped the program (``max_turns``, ``max_tokens``), else empty."""
    infra: str = ""
    """The gateway's own fault, if any (masks the episode)."""
    agent_diff_error: str = ""
    """The diff failed on a workspace the policy made (scored, never masked)."""
    log_tail: str = ""
    """The end of the program's output (stdout and stderr)."""
    model_s: float = 0.0
    """Seconds the program waited for finished calls (not counted against ``timeout_s``)."""
    calling_since: float | None = None
    """When the call in flight started (``time.monotonic()``), else None."""
    turn: Turn | None = None
    """The last call, which the next may continue token for token."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    process: subprocess.Popen[bytes] | None = None


class Gateway:
    """The per-rollout HTTP endpoint: each episode's chat completions and sandbox commands
    behind its secret path (an unknown secret is a 404)."""

    def __init__(
        self, policy: SamplingPolicy, params: SamplingParams, opts: GatewayOptions, budget: int,
        max_calls: int,
    ) -> None:  # fmt: skip
        self.policy, self.params, self.opts = policy, params, opts
        self.budget, self.max_calls = budget, max_calls
        self.episodes: dict[str, _Episode] = {}
        self.batcher = WindowBatcher(0.05)

    def add(self, ep: _Episode) -> None:
        self.episodes[ep.secret] = ep

    def _episode(self, secret: str) -> _Episode:
        ep = self.episodes.get(secret)
        if ep is None:
            raise HTTPException(404, "unknown endpoint")
        return ep

    def _stop(self, ep: _Episode, ending: str) -> None:
        ep.ending = ep.ending or ending
        if ep.process is not None and ep.process.poll() is None:
            os.killpg(ep.process.pid, signal.SIGTERM)

    def stop_all(self) -> None:
        """End every program now (SIGKILL to its process group; one not started yet never
        starts): the rollout was interrupted (Ctrl-C, SIGTERM), and a program left running would
        hold the command until its own ``timeout_s``."""
        for ep in list(self.episodes.values()):
            with ep.lock:
                ep.ending = ep.ending or "interrupted"
                if ep.process is not None and ep.process.poll() is None:
                    os.killpg(ep.process.pid, signal.SIGKILL)

    def complete(self, ep: _Episode, req: ChatRequest) -> dict[str, Any]:
        """Sample and record one call of ``ep`` (see the module docstring).

        Raises:
            HTTPException: 400 for a request coderl cannot serve or a spent budget (the
                program is then stopped), 503 when the engine failed (an infra fault).
        """
        ep.calling_since = start = time.monotonic()
        try:
            return self._complete(ep, req)
        finally:
            ep.model_s += time.monotonic() - start
            ep.calling_since = None

    def _complete(self, ep: _Episode, req: ChatRequest) -> dict[str, Any]:
        with self.batcher.incoming(), ep.lock:  # one call of an episode at a time
            if len(ep.calls) >= self.max_calls or ep.sampled >= self.budget:
                ending = "max_turns" if len(ep.calls) >= self.max_calls else "max_tokens"
                self._stop(ep, ending)
                raise HTTPException(400, f"episode limit reached ({ending})")
            try:
                s = sample_chat(
                    req,
                    self.policy.tokenizer,  # type: ignore[attr-defined]
                    client_tools(req.tools),
                    self._generate(ep),
                    temperature=self.params.temperature,
                    max_new_tokens=min(self.params.max_new_tokens, self.budget - ep.sampled),
                    context=context_limit(self.policy),
                    call_format=self.opts.call_format,
                    template_tools=self.opts.template_tools,
                    previous=ep.turn,
                )
            except ContextFullError as e:  # the program's history filled the context: scored
                self._stop(ep, "context")
                raise ApiError(400, str(e), param=e.param) from None
            except RequestError as e:
                raise ApiError(400, str(e), param=e.param) from None
            ep.turn = s.turn
            # any model name is answered (one policy is served) and recorded with the call
            call = Call(s.prompt_ids, s.completion, {"status": s.status, "model": req.model})
            ep.calls.append(call)
            ep.statuses.append(s.status)
            ep.sampled += len(s.completion.token_ids)
        iid = f"chatcmpl-{ep.index}-{len(ep.calls)}"
        return response_body(
            iid, req.model, int(time.time()), s, self.policy.tokenizer, logprobs=bool(req.logprobs)  # type: ignore[attr-defined]
        )  # fmt: skip

    def _generate(self, ep: _Episode) -> Any:
        def generate(prompt: list[int], params: SamplingParams) -> Any:
            seed = None  # batched with every call waiting
            if self.opts.seeded and self.params.seed is not None:
                seed = self.params.seed * 1_000_003 + ep.index * 10_007 + len(ep.calls)
            params = replace(params, top_p=self.params.top_p, seed=seed)
            try:
                return generate_one(self.policy, prompt, params, self.batcher)
            except EngineError as e:  # the engine's fault: infra, masked
                warn_masked(log, "episode %d: engine failure (masked)", ep.index)
                ep.infra = ep.infra or str(e)
                raise HTTPException(503, ep.infra) from None

        return generate

    def execute(self, ep: _Episode, body: dict[str, Any]) -> dict[str, Any]:
        """Run ``body["argv"]`` in ``body["cwd"]`` with ``body["env"]`` in ``ep``'s sandbox;
        ``{"output", "returncode"}`` (stdout and stderr merged).

        Raises:
            HTTPException: 400 for a request the program (or the model through it) got wrong
                (:func:`exec_command`): the program's to handle, never a mask; 503 when the
                sandbox failed on a valid command (infra, masked).
        """
        cmd = exec_command(body)
        try:
            r = ep.sandbox.exec(cmd, timeout=self.opts.exec_timeout_s)
        except (SandboxError, OSError) as e:  # the sandbox's fault, not the command's: infra
            warn_masked(log, "episode %d: sandbox exec failed (masked)", ep.index)
            ep.infra = ep.infra or f"sandbox exec failed: {type(e).__name__}: {e}"
            raise HTTPException(503, ep.infra) from None
        out = r.stdout + r.stderr
        if r.timed_out:
            out += f"\n[coderl: the command timed out after {self.opts.exec_timeout_s:g} s]"
        return {"output": out, "returncode": r.exit_code}

    def app(self) -> FastAPI:
        app = install_error_handlers(FastAPI(title="coderl gateway"))

        @app.post("/e/{secret}/v1/chat/completions")
        async def chat(secret: str, request: Request) -> Response:
            ep = self._episode(secret)
            return await chat_endpoint(request, lambda req: self.complete(ep, req))

        @app.get("/e/{secret}/v1/models")
        def models(secret: str) -> dict[str, Any]:
            self._episode(secret)
            return {"object": "list", "data": [{"id": self.opts.model, "object": "model",
                                                "owned_by": "coderl", "created": 0}]}  # fmt: skip

        @app.post("/e/{secret}/exec")
        def execute(secret: str, body: dict[str, Any]) -> dict[str, Any]:
            return self.execute(self._episode(secret), body)

        return app


MAX_EXEC_BYTES = 1 << 20
"""The longest command line (argv, cwd and env together, UTF-8) an ``/exec`` request may send."""


def exec_command(body: dict[str, Any]) -> str:
    """The shell command that runs an ``/exec`` request's ``argv`` in ``cwd`` (default
    ``/testbed``) with ``env``, stdout and stderr merged.

    Raises:
        HTTPException: 400 when the request cannot be a command: ``argv`` not a non-empty list
            of strings, ``cwd`` not a string, ``env`` not an object of strings, a string holding
            NUL or a lone surrogate (not UTF-8), or more than ``MAX_EXEC_BYTES`` in all. That is
            the program's (or the model's) input, so it is answered, never turned into a mask.
    """
    argv, cwd, env = body.get("argv"), body.get("cwd") or "/testbed", body.get("env") or {}
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        raise HTTPException(400, "argv must be a non-empty list of strings")
    if not isinstance(cwd, str) or not isinstance(env, dict):
        raise HTTPException(400, "cwd must be a string and env an object")
    if not all(isinstance(v, str) for v in env.values()):
        raise HTTPException(400, "env values must be strings")
    texts = [*argv, cwd, *env, *env.values()]
    size = 0
    for text in texts:
        if "\0" in text:
            raise HTTPException(400, "a command cannot hold a NUL character")
        try:
            size += len(text.encode())
        except UnicodeEncodeError:
            raise HTTPException(400, "a command must be valid UTF-8 (no lone surrogates)") from None
    if size > MAX_EXEC_BYTES:
        raise HTTPException(400, f"a command may hold at most {MAX_EXEC_BYTES} bytes, got {size}")
    exports = "".join(f"export {k}={shlex.quote(v)}; " for k, v in env.items() if k.isidentifier())
    return f"( {exports}cd {shlex.quote(cwd)} && {shlex.join(argv)} ) 2>&1"


def _wait(ep: _Episode, timeout_s: float) -> int | None:
    """The program's exit status, or None once it has run ``timeout_s`` seconds of its own
    (time spent waiting for the model is not its own)."""
    assert ep.process is not None
    start = time.monotonic()
    while True:
        now, since = time.monotonic(), ep.calling_since
        waiting = ep.model_s + (now - since if since is not None else 0.0)
        left = timeout_s + waiting - (now - start)
        if left <= 0:
            return None
        try:
            return ep.process.wait(timeout=min(left, 1.0))
        except subprocess.TimeoutExpired:
            continue


PACKAGE_ROOT = Path(__file__).resolve().parent.parent.parent
"""The directory that holds the ``coderl`` package (``$CODERL_ROOT``: the checkout, for a
source install)."""


def program_dirs() -> dict[str, str]:
    """The directories a program's command line may name: ``CODERL_LAUNCH_DIR`` (where coderl
    was started) and ``CODERL_ROOT`` (:data:`PACKAGE_ROOT`)."""
    return {"CODERL_LAUNCH_DIR": os.getcwd(), "CODERL_ROOT": str(PACKAGE_ROOT)}


def check_program(program: str) -> None:
    """Refuse a program whose first word (after ``NAME=value`` assignments) is a path that does
    not exist once ``$CODERL_LAUNCH_DIR`` and ``$CODERL_ROOT`` are expanded; a bare command
    name, a word with other variables, or a line shlex cannot split is left to the run.

    Raises:
        ConfigError: the program's path does not exist (one line, naming it).
    """
    try:
        words = shlex.split(program)
    except ValueError:
        return
    words = [w for w in words if not re.fullmatch(r"[A-Za-z_]\w*=.*", w)][:1]
    if not words:
        return
    dirs = program_dirs()
    path = re.sub(r"\$(\w+)|\$\{(\w+)\}", lambda m: dirs.get(m[1] or m[2], m[0]), words[0])
    if "/" in path and "$" not in path and not Path(path).exists():
        raise ConfigError(
            f"tasks.options.program: {path} does not exist (from {words[0]}; $CODERL_ROOT is "
            f"{dirs['CODERL_ROOT']}, $CODERL_LAUNCH_DIR {dirs['CODERL_LAUNCH_DIR']}; "
            "mini-swe-agent: make agents; docs/harness-byo.md)"
        )


def run_program(ep: _Episode, opts: GatewayOptions, base_url: str, statement: str) -> str:
    """Run the program for ``ep`` to its end; returns its finish reason (``exited``: exit
    0; ``program_error``: non-zero exit; ``timeout``; or the gateway's ``ep.ending``)."""
    scratch = Path(tempfile.mkdtemp(prefix=f"coderl-gw-{ep.index}-"))
    try:
        shim = scratch / "coderl-exec"
        shim.write_text(f"#!{sys.executable}\n" + EXEC_SHIM.read_text())
        shim.chmod(0o755)
        (scratch / "task.md").write_text(statement)
        url = f"{base_url}/e/{ep.secret}"
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "LANG": os.environ.get("LANG", "C.UTF-8"),
            "HOME": str(scratch),
            "OPENAI_BASE_URL": f"{url}/v1",
            "OPENAI_API_BASE": f"{url}/v1",
            "OPENAI_API_KEY": ep.secret,
            "CODERL_MODEL": opts.model,
            "CODERL_SANDBOX_URL": f"{url}/exec",
            "CODERL_EXEC": str(shim),
            "MSWEA_DOCKER_EXECUTABLE": str(shim),
            "CODERL_TASK_FILE": str(scratch / "task.md"),
            "CODERL_TASK_ID": str(ep.task.id),
            "CODERL_OUTPUT_DIR": str(scratch),
            **program_dirs(),
        }
        log = open(scratch / "program.log", "wb")  # noqa: SIM115 - closed below
        with ep.lock:
            if ep.ending == "interrupted":  # Gateway.stop_all came first
                log.close()
                return ep.ending
            ep.process = subprocess.Popen(
                ["bash", "-c", opts.program], cwd=scratch, env=env, stdout=log,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        try:
            code = _wait(ep, opts.timeout_s)
        finally:
            try:  # what it left running (or all of it, past its time)
                os.killpg(ep.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            ep.process.wait()
            log.close()
        ep.log_tail = (scratch / "program.log").read_text(errors="replace")[-2000:]
        if code is None:
            return "timeout"
        if ep.ending:
            return ep.ending
        return "exited" if code == 0 else "program_error"
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _record(ep: _Episode, finish: str, diff: str | None) -> EpisodeRecord:
    """The driver's view of one program run (see the module docstring for who failed)."""
    traj, _ = trajectory_of(ep.calls)
    failure: FailureKind | None = None
    reason = ""
    tail = ep.log_tail.strip().splitlines()
    last = tail[-1] if tail else "no output"
    if ep.infra:
        failure, reason = "infra", ep.infra
    elif not ep.calls:  # nothing the policy sampled reached the program: not the policy's doing
        failure, reason = "infra", f"the program never called the model ({finish}): {last}"
    elif ep.agent_diff_error:
        failure, reason = "agent", ep.agent_diff_error
    elif diff is None:
        failure, reason = "infra", "the sandbox's diff could not be taken"
    elif finish in ("program_error", "timeout"):
        failure, reason = "agent", f"program {finish}: {last}"
    return EpisodeRecord(
        task_id=ep.task.id,
        trajectory=traj,
        finish_reason=finish,
        turns=len(ep.calls),
        truncated=finish in ("max_turns", "max_tokens", "timeout"),
        broken_tool_calls=ep.statuses.count("invalid"),
        parsed_calls=True,
        no_action_turns=ep.statuses.count("none"),
        answer=diff or "",
        failure=failure,
        failure_reason=reason,
    )


@dataclass
class GatewayEnvironment:
    """Tasks, sandboxes and grades of ``inner``; episodes from the user's program."""

    cfg: Config
    inner: AgentEnvironment
    opts: GatewayOptions

    def tasks(self, split: str) -> list[Any]:
        return self.inner.tasks(split)

    def ease(self, task: Any) -> float | None:
        return self.inner.ease(task)

    def token_budget(self) -> int:
        return self.inner.token_budget()

    def grade(self, tasks: list[Any], episodes: list[EpisodeRecord]) -> list[GradeRecord]:
        return self.inner.grade(tasks, episodes)

    def statement(self, task: Any) -> str:
        return str(task.problem_statement)

    def rollout(
        self, policy: SamplingPolicy, tasks: list[Any], params: SamplingParams, group_size: int
    ) -> list[EpisodeRecord]:
        """``group_size`` program runs per task, task-major, concurrently (at most
        ``rollout.concurrency``), against one endpoint and one batched policy."""
        gw = Gateway(policy, params, self.opts, self.token_budget(), self.cfg.rollout.max_turns)
        owners = [t for t in tasks for _ in range(group_size)]
        server = BackgroundServer(gw.app())
        try:
            with thread_pool(max(1, self.cfg.rollout.concurrency)) as pool:
                return list(pool.map(lambda it: self._one(gw, server.base_url[:-3], *it),
                                     enumerate(owners)))  # fmt: skip
        except BaseException:  # Ctrl-C or SIGTERM (the CLI raises it here): no program outlives it
            gw.stop_all()
            raise
        finally:
            server.stop()
            gw.batcher.close()

    def _one(self, gw: Gateway, base_url: str, index: int, task: Any) -> EpisodeRecord:
        try:
            sandbox = sandbox_for(task)
        except SETUP_FAULTS as e:  # infrastructure: masked and counted
            warn_masked(log, "task %s: sandbox could not start (masked)", task.id)
            return EpisodeRecord(task.id, Trajectory(), "error", 0, failure="infra",
                                 failure_reason=f"sandbox could not start: {type(e).__name__}: {e}")  # fmt: skip
        ep = _Episode(index, task, sandbox, secrets.token_urlsafe(24))
        gw.add(ep)
        try:
            finish = run_program(ep, self.opts, base_url, self.statement(task))
            try:
                diff: str | None = sandbox.diff()
            except DIFF_FAULTS as e:  # without a diff the episode cannot be graded
                diff = None
                if diff_failure(e) == "agent":  # a workspace the policy made: scored, as native
                    ep.agent_diff_error = f"the workspace's diff failed: {type(e).__name__}: {e}"
                else:
                    warn_masked(log, "task %s: diff failed (masked)", task.id)
                    ep.infra = ep.infra or f"diff failed: {type(e).__name__}: {e}"
            return _record(ep, finish, diff)
        finally:
            gw.episodes.pop(ep.secret, None)  # its endpoint ends with it
            sandbox.close()


GATEWAY_KEYS = {"program", "timeout_s", "exec_timeout_s", "model", "call_format",
                "template_tools", "seeded", "inner"}  # fmt: skip
