"""The vLLM rollout engine: an :class:`~coderl.policy.base.Engine` that samples through a vLLM
OpenAI-compatible server, with versioned LoRA weight sync and a canary after every sync.

Sampling: one ``POST /v1/completions`` per prompt, all in flight at once (the server batches them
continuously), with the prompt given as token ids, ``logprobs: 0`` and
``return_tokens_as_token_ids: true``: the reply carries each sampled id (``"token_id:N"``) and its
logprob under the distribution it was drawn from, provided the server runs with ``--logprobs-mode
processed_logprobs`` (temperature applied, as coderl's trainer recomputes it). Nothing is
re-tokenised on either side. ``finish_reason`` is the server's: ``"stop"`` (EOS or a stop id was
sampled; it is the last token, checked) or ``"length"``; anything else raises.

Weight sync (:meth:`VLLMEngine.sync`, after every optimizer step): the LoRA adapter is saved as
safetensors and loaded with ``POST /v1/load_lora_adapter`` under a name unique to this engine and
version; requests then name that adapter. An older adapter is unloaded once no request in flight
uses it. Then the canary: a fixed probe sequence is scored by the server (``prompt_logprobs``,
temperature 1) and by the trainer; a mean |logprob gap| above ``canary_max_gap`` raises
:class:`CanaryError` naming the version and the gap, and the engine keeps serving the previous
version, so no rollout of the bad one is ever produced. Measured when the weights agree: fp32 server,
2e-7 (tiny-random) and 8e-6 (SmolLM2-135M) nats; a bf16 server against the fp32 trainer, 3.3e-2
(SmolLM2), so in bf16 the canary catches a wrong or missing adapter but not a slightly stale one.

Per-population adapters (``coderl serve`` with ``online.populations``): :meth:`VLLMEngine.
load_adapter` loads a population's champion next to the synced versions under a name of its own
(``<tag>-<population>-v<version>-s<n>``), canary-checked, and keeps it loaded until that
population's next adapter replaces it; ``generate(..., adapter=name)`` samples with it. The
synced default version is untouched, and vLLM batches requests of different adapters together.

Differences from :class:`~coderl.policy.engine.TorchEngine`:

- with ``top_p < 1`` vLLM reports logprobs of the truncated (renormalised) distribution, which is
  what the behaviour policy was; coderl's own sampler reports the full tempered one;
- seeds: prompt ``i`` of a call gets ``seed + i`` (vLLM seeds per request), so equal seeds give
  equal samples and identical prompts in one call still differ;
- greedy (temperature 0) logprobs are vLLM's processed ones, not checked against the trainer.

Full fine-tuning (``full_sync``): every sync writes all weights and has the server reload them in
place through vLLM's development endpoints (:mod:`coderl.policy.vllm_reload`), stamps the server's
weight version (read back and checked) and resets its prefix cache; the canary then checks the new
weights exactly as it checks an adapter. One version is served at a time, and after a failed
full sync none is.

Limits: with a server given by URL the adapter (or weight) directory must be readable by the
server at the same path.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import requests

from coderl.policy.base import Completion, SamplingParams
from coderl.policy.engine import check_params
from coderl.policy.vllm_reload import (
    DEV_MODE_ENV,
    reload_rpc,
    served_weight_version,
    swap_weights,
    write_weights,
)
from coderl.policy.vllm_server import VLLMServer

# The development endpoints a full-weight sync calls (404 on a server without DEV_MODE_ENV=1).
DEV_PATHS = ("/pause", "/resume", "/collective_rpc", "/reset_prefix_cache",
             "/update_weight_version", "/weight_info")  # fmt: skip

# The probe the canary scores after every sync: code-like text, so a real model's logprobs are
# neither near 0 nor extreme; token ids come from the policy's own tokenizer.
CANARY_TEXT = (
    "def fizzbuzz(n):\n    out = []\n    for i in range(1, n + 1):\n"
    "        if i % 15 == 0:\n            out.append('FizzBuzz')\n"
)


class EngineError(RuntimeError):
    """The vLLM server refused a request, answered nonsense or could not be reached."""


class CanaryError(RuntimeError):
    """After a weight sync the engine's logprobs on the probe disagree with the trainer's."""


def canary_probe(tokenizer: Any, min_tokens: int = 16) -> list[int]:
    """The canary's fixed token sequence: :data:`CANARY_TEXT` in the policy's tokenizer.

    Raises:
        ValueError: it encodes to fewer than ``min_tokens`` tokens.
    """
    ids = [int(t) for t in tokenizer.encode(CANARY_TEXT, add_special_tokens=False)]
    if len(ids) < min_tokens:
        raise ValueError(f"the canary probe encodes to {len(ids)} tokens (< {min_tokens})")
    return ids


class VLLMEngine:
    """A client of one vLLM OpenAI-compatible server (see the module docstring).

    Args:
        url: the server's base URL (``http://host:port``).
        eos_token_ids: stop tokens of every request unless ``ignore_eos``.
        served_name: the server's name for the base model (``--served-model-name``).
        canary_max_gap: largest mean |logprob gap| (nats) on the probe that a sync accepts.
        adapter_dir: where adapters and full weights are written (default: a fresh temporary
            directory).
        full_sync: sync a policy without LoRA by writing all its weights and reloading them in
            the server (:mod:`coderl.policy.vllm_reload`; the server needs
            ``VLLM_SERVER_DEV_MODE=1``). False: such a policy is served as the server started,
            and a sync after its weights changed raises.
        server: the :class:`VLLMServer` this engine owns (stopped by :meth:`close`), or None
            for a server run by someone else.
        timeout_s: per-request HTTP timeout.
        max_concurrency: requests in flight at once.

    Raises:
        EngineError: the server does not answer ``GET /v1/models`` or does not serve
            ``served_name``.
    """

    def __init__(
        self,
        url: str,
        eos_token_ids: Sequence[int],
        *,
        served_name: str = "coderl-base",
        canary_max_gap: float = 1e-3,
        adapter_dir: str | os.PathLike[str] | None = None,
        server: VLLMServer | None = None,
        timeout_s: float = 600.0,
        max_concurrency: int = 64,
        full_sync: bool = False,
    ):
        self.url = url.rstrip("/")
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self.served_name = served_name
        self.canary_max_gap = canary_max_gap
        self.server = server
        self.timeout_s = timeout_s
        self.max_concurrency = max_concurrency
        self.full_sync = full_sync
        self._tmp = None if adapter_dir else tempfile.TemporaryDirectory(prefix="coderl-lora-")
        self.adapter_dir = Path(adapter_dir or self._tmp.name)  # type: ignore[union-attr]
        self.tag = f"coderl-{secrets.token_hex(3)}"
        self.version: int | None = None
        """The weight version requests use by default (None before the first :meth:`sync`)."""
        self.last_canary_gap: float | None = None
        """Mean |logprob gap| of the last canary (nats)."""
        self.last_sync_s: dict[str, float] = {}
        """Seconds the last full-weight sync spent in ``write``, ``reload`` and ``canary``."""
        self._weights: Path | None = None  # the served full weights' directory (full_sync)
        self._names: dict[int, str] = {}  # version -> model name (adapter, or the base)
        self._paths: dict[str, Path] = {}  # adapter name -> its directory (deleted on unload)
        self._inflight: Counter[str] = Counter()  # model name -> requests in flight
        self._pinned: dict[str, str] = {}  # population -> its adapter's name (kept loaded)
        self._loading: set[str] = set()  # adapters loaded, not yet served or pinned (kept)
        self._lock = threading.Lock()
        self._syncs = 0
        models = self._request("GET", "/v1/models")
        served = {m["id"]: m for m in models["data"]}
        if served_name not in served:
            raise EngineError(f"{self.url} serves {sorted(served)}, not {served_name!r}")
        self.max_model_len = int(served[served_name]["max_model_len"])

    # --- HTTP -------------------------------------------------------------------------------

    def _request(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        params: dict[str, str] | None = None,
    ) -> Any:
        try:
            r = requests.request(
                method, self.url + path, json=body, params=params, timeout=self.timeout_s
            )
        except requests.RequestException as err:
            raise EngineError(f"vLLM server at {self.url} unreachable ({path}): {err}"
                              f"{self._server_state()}") from None  # fmt: skip
        if r.status_code == 404 and path in DEV_PATHS:
            raise EngineError(f"vLLM {path} answered 404: full-weight sync needs the server's "
                              f"development endpoints ({DEV_MODE_ENV}=1 in its environment)")  # fmt: skip
        if r.status_code != 200:
            raise EngineError(f"vLLM {path} answered {r.status_code}: {_message(r)}")
        return r.json() if r.content and "json" in r.headers.get("content-type", "") else r.text

    def _server_state(self) -> str:
        if self.server is None:
            return ""
        code = self.server.exit_code(wait_s=3.0)  # a dropped connection comes just before the exit
        state = "running" if code is None else f"exited with code {code}"
        return f"; the server process {state}{self.server.last_log_lines()}"

    # --- sampling ---------------------------------------------------------------------------

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        *,
        version: int | None = None,
        adapter: str | None = None,
    ) -> list[Completion]:
        """Sample one completion per token-id prompt with the weights of ``version``
        (default: the latest synced one), or with a population's ``adapter`` (a name
        :meth:`load_adapter` returned; completions then carry no version); see
        :class:`coderl.policy.base.Engine`.

        A completion stops at the server's context end: ``max_new_tokens`` is cut to
        ``max_model_len - len(prompt)`` (``finish_reason`` is then ``"length"``).

        Raises:
            ValueError: empty prompts, out-of-range ``params``, a prompt that fills the server's
                context (``max_model_len``), or a version or adapter this engine does not serve.
            EngineError: the server failed or died (its exit code and last log lines when this
                engine started it).
        """
        check_params(params)
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("generate needs a non-empty list of non-empty prompts")
        too_long = [len(p) for p in prompts if len(p) >= self.max_model_len]
        if too_long:
            raise ValueError(
                f"prompt of {too_long[0]} tokens leaves no room to sample: the vLLM server's "
                f"context (max_model_len) is {self.max_model_len} tokens"
            )
        v = self.version if version is None else version
        with self._lock:
            if adapter is not None:
                if adapter not in self._pinned.values():
                    raise ValueError(f"adapter {adapter!r} is not loaded "
                                     f"(populations: {sorted(self._pinned)})")  # fmt: skip
                name, v = adapter, None
            elif v is None or v not in self._names:
                raise ValueError(f"version {v} is not served (synced: {sorted(self._names)})")
            else:
                name = self._names[v]
            self._inflight[name] += 1
        try:
            workers = min(len(prompts), self.max_concurrency)
            with ThreadPoolExecutor(max_workers=workers) as pool:
                futures = [
                    pool.submit(self._complete, name, p, params, i) for i, p in enumerate(prompts)
                ]
                out = [f.result() for f in futures]
        finally:
            with self._lock:
                self._inflight[name] -= 1
        self._unload_unused()  # not on failure: a dead server must not mask the first error
        for c in out:
            c.policy_version = v
        return out

    def _complete(
        self, model: str, prompt: list[int], params: SamplingParams, i: int
    ) -> Completion:
        eos = [] if params.ignore_eos else self.eos_token_ids
        stops = sorted(set(eos) | set(params.stop_token_ids))
        body: dict[str, Any] = {
            "model": model,
            "prompt": prompt,
            "max_tokens": min(params.max_new_tokens, self.max_model_len - len(prompt)),
            "temperature": params.temperature,
            "top_p": params.top_p,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
            "stop_token_ids": stops,
            "ignore_eos": params.ignore_eos,
            # explicit, so no default from the model's generation_config or the server applies
            "top_k": 0,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "skip_special_tokens": False,
        }
        if params.seed is not None:
            body["seed"] = params.seed + i
        choice = self._request("POST", "/v1/completions", body)["choices"][0]
        lp = choice.get("logprobs") or {}
        ids = [_token_id(t) for t in lp.get("tokens") or []]
        logprobs = [float(x) for x in lp.get("token_logprobs") or []]
        if not ids or len(ids) != len(logprobs):
            raise EngineError(f"vLLM returned {len(ids)} tokens and {len(logprobs)} logprobs")
        reason = choice.get("finish_reason")
        if reason == "stop":
            if ids[-1] not in stops:
                raise EngineError(
                    f"vLLM finished with 'stop' (stop_reason {choice.get('stop_reason')!r}) "
                    f"on token {ids[-1]}, which is no stop token of this request ({stops})"
                )
        elif reason != "length":
            raise EngineError(f"vLLM finish_reason {reason!r}: neither 'stop' nor 'length'")
        return Completion(token_ids=ids, logprobs=logprobs, finish_reason=reason)

    def score(self, token_ids: Sequence[int], *, version: int | None = None) -> list[float]:
        """The server's logprob of every token of ``token_ids`` given its prefix, temperature 1.

        Aligned as :meth:`coderl.policy.local.LocalPolicy.logprobs`: entry 0 is 0.0.

        Raises:
            ValueError: a version this engine does not serve.
            EngineError: the server failed.
        """
        v = self.version if version is None else version
        if v is None or v not in self._names:
            raise ValueError(f"version {v} is not served (synced: {sorted(self._names)})")
        return self._score(self._names[v], list(token_ids))

    def _score(self, model: str, ids: list[int]) -> list[float]:
        body = {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 1.0,
                "prompt_logprobs": 0}  # fmt: skip
        choice = self._request("POST", "/v1/completions", body)["choices"][0]
        rows = choice.get("prompt_logprobs") or []
        if len(rows) != len(ids):
            raise EngineError(f"vLLM scored {len(rows)} of {len(ids)} prompt tokens")
        out = [0.0]
        for t, row in zip(ids[1:], rows[1:], strict=True):
            out.append(float(row[str(t)]["logprob"]))
        return out

    # --- weight sync ------------------------------------------------------------------------

    def sync(self, policy: Any) -> float:
        """Serve ``policy``'s current weights as version ``policy.version``, checked by the canary.

        LoRA: the adapter is written (safetensors) and loaded under a new name. Without LoRA and
        with ``full_sync``: every weight is written and reloaded in the server in place
        (:meth:`sync_full`). Without either only the first sync is accepted: the server was
        started from these very weights.

        Returns:
            The canary's mean |logprob gap| (nats).

        Raises:
            ValueError: full fine-tuning after its weights changed without ``full_sync``.
            CanaryError: the engine's logprobs on the probe differ from the trainer's by more
                than ``canary_max_gap`` (the version is not served; with an adapter the previous
                one still is, after a full sync none is).
            EngineError: the server refused the adapter or the reload.
        """
        version = int(policy.version)
        if policy.is_lora:
            path = self.write_adapter(policy)
            name = f"{self.tag}-v{version}-s{self._syncs}"
            self._syncs += 1
            self._load(name, path)
        elif self.full_sync:
            return self.sync_full(policy)
        elif not self._names:
            name = self.served_name
        else:
            raise ValueError(
                "this VLLMEngine syncs weights as LoRA adapters; this policy fine-tunes every "
                "weight (model.lora=false): build the engine with full_sync=True (a server with "
                f"{DEV_MODE_ENV}=1; build_engine does both when training), or use model.lora=true"
            )
        try:
            gap = self._canary(policy, name, version)
            with self._lock:
                self._names[version] = name
                self.version = version
        finally:
            with self._lock:
                self._loading.discard(name)
        self._unload_unused()
        return gap

    def sync_full(self, policy: Any) -> float:
        """Write every weight of ``policy``, reload them in the server in place, reset its prefix
        cache, stamp and read back the server's weight version, then run the canary
        (:mod:`coderl.policy.vllm_reload`). Times go to :attr:`last_sync_s`.

        While it runs and after it fails, no version is served (the server has one set of base
        weights and they are being replaced): a request raises until a sync succeeds.

        Returns:
            The canary's mean |logprob gap| (nats).

        Raises:
            EngineError: a request or a held version is in flight (it would see two sets of
                weights), an endpoint refused, the prefix cache was not reset, or the server
                reports another weight version than the one just stamped.
            CanaryError: the server's logprobs on the probe are not the trainer's.
        """
        version = int(policy.version)
        with self._lock:
            busy = {n: c for n, c in self._inflight.items() if c > 0}
            if busy:
                raise EngineError(
                    f"full-weight sync of version {version} replaces the weights every request "
                    f"uses, and requests or held versions are in flight: {busy}"
                )
            self._names = {}  # nothing is served until the canary accepts the new weights
        stamp = f"{self.tag}-v{version}-s{self._syncs}"
        self._syncs += 1
        t0 = time.perf_counter()
        path = self.write_weights(policy, self.adapter_dir / f"full-{stamp}")
        t1 = time.perf_counter()
        if not swap_weights(self._request, path, stamp, reload=self._reload):
            raise EngineError(f"vLLM did not reset its prefix cache after reloading version "
                              f"{version}: KV of the old weights could be reused")  # fmt: skip
        reported = self.weight_version()
        if reported != stamp:
            raise EngineError(f"after the sync of version {version} the vLLM server reports "
                              f"weight version {reported!r}, not {stamp!r}")  # fmt: skip
        t2 = time.perf_counter()
        gap = self._canary(policy, self.served_name, version)
        t3 = time.perf_counter()
        with self._lock:
            self._names = {version: self.served_name}
            self.version = version
            previous, self._weights = self._weights, path
        if previous is not None and previous != path and previous.is_relative_to(self.adapter_dir):
            shutil.rmtree(previous, ignore_errors=True)
        self.last_sync_s = {"write": t1 - t0, "reload": t2 - t1, "canary": t3 - t2}
        return gap

    def write_weights(self, policy: Any, path: Path) -> Path:
        """Save all of ``policy``'s weights for a full sync (:func:`vllm_reload.write_weights`)."""
        return write_weights(policy, path)

    def _reload(self, request: Any, path: Path) -> None:
        reload_rpc(request, path)

    def weight_version(self) -> str:
        """The weight version the server reports (``GET /weight_info``)."""
        return served_weight_version(self._request)

    def _load(self, name: str, path: Path) -> None:
        """Load the adapter at ``path`` as ``name``, protected from :meth:`_unload_unused`
        until its caller discards it from ``_loading`` (after the canary, once it is served or
        pinned): a request of another thread that finishes during the canary would otherwise
        unload an adapter that is not yet the current version and is about to become it."""
        with self._lock:
            self._loading.add(name)
        try:
            self._request(
                "POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)}
            )
        except BaseException:
            with self._lock:
                self._loading.discard(name)
            raise
        with self._lock:
            self._paths[name] = path

    def load_adapter(self, policy: Any, population: str, version: int) -> str:
        """Load ``policy``'s LoRA adapter as ``population``'s (registry ``version``), checked by
        the canary, replacing that population's previous adapter (unloaded once no request in
        flight uses it). The synced default version is untouched.

        Returns:
            The adapter's name, for ``generate(..., adapter=name)``.

        Raises:
            ValueError: a policy without LoRA.
            CanaryError: the server's logprobs disagree (the previous adapter stays served).
            EngineError: the server refused the adapter.
        """
        if not policy.is_lora:
            raise ValueError("per-population adapters need model.lora=true")
        path = self.write_adapter(policy)
        name = f"{self.tag}-{population}-v{version}-s{self._syncs}"
        self._syncs += 1
        self._load(name, path)
        try:
            self._canary(policy, name, version)
            with self._lock:
                self._pinned[population] = name
        finally:
            with self._lock:
                self._loading.discard(name)
        self._unload_unused()
        return name

    def write_adapter(self, policy: Any) -> Path:
        """Save ``policy``'s LoRA adapter (peft ``save_pretrained``, safetensors) for its version.

        Returns:
            The adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``).
        """
        path = self.adapter_dir / f"v{policy.version}-s{self._syncs}"
        policy.model.save_pretrained(path, safe_serialization=True)
        return path

    def _canary(self, policy: Any, name: str, version: int) -> float:
        probe = canary_probe(policy.tokenizer)
        engine = self._score(name, probe)
        trainer: list[float] = policy.logprobs([probe], 1.0)[0]
        gaps = [abs(a - b) for a, b in zip(engine[1:], trainer[1:], strict=True)]
        gap = sum(gaps) / len(gaps)
        self.last_canary_gap = gap
        if not gap <= self.canary_max_gap:  # also catches NaN
            if name != self.served_name:
                with self._lock:
                    path = self._paths.pop(name, None)
                self._unload(name, path)
            raise CanaryError(
                f"sync canary: the engine's weights for version {version} (model {name!r}) "
                f"disagree with the trainer's: mean |logprob gap| {gap:.3g} nats on the "
                f"{len(probe)}-token probe > engine.canary_max_gap {self.canary_max_gap:g}. The "
                "engine serves other weights than the trainer holds (a skipped or failed sync, "
                "a wrong adapter, or a dtype mismatch); no rollout of this version was sampled."
            )
        return gap

    def _unload_unused(self) -> None:
        """Unload every adapter but the current version's and the populations' that no request
        in flight uses (older versions, and an adapter a re-sync of the same version or a
        population's next adapter replaced)."""
        with self._lock:
            current = self._names.get(self.version) if self.version is not None else None
            keep = {current, *self._pinned.values(), *self._loading}
            names = [n for n in self._paths if n not in keep and self._inflight[n] == 0]
            self._names = {v: n for v, n in self._names.items() if n not in names}
            paths = {n: self._paths.pop(n) for n in names}  # claimed: no other thread unloads it
        for name, path in paths.items():
            self._unload(name, path)

    def _unload(self, name: str, path: Path | None) -> None:
        self._request("POST", "/v1/unload_lora_adapter", {"lora_name": name})
        if path is not None and path.is_relative_to(self.adapter_dir):
            shutil.rmtree(path, ignore_errors=True)

    def hold(self, version: int) -> int:
        """Keep ``version``'s weights loaded until :meth:`release` (an async worker samples one
        version through several calls and turns). When ``version`` was already replaced and
        unloaded (the learner synced twice before the worker picked it up), the newest served
        version is held instead: never an older one.

        Returns:
            The version held (``version`` or newer).

        Raises:
            ValueError: nothing at ``version`` or newer is served.
        """
        with self._lock:
            newer = [v for v in self._names if v >= version]
            if not newer:
                raise ValueError(f"version {version} is not served (synced: {sorted(self._names)})")
            held = version if version in self._names else max(newer)
            self._inflight[self._names[held]] += 1
            return held

    def release(self, version: int) -> None:
        """Undo one :meth:`hold` of ``version``; its adapter is unloaded once unused and old."""
        with self._lock:
            self._inflight[self._names[version]] -= 1
        self._unload_unused()

    def served_versions(self) -> list[int]:
        """Versions requests can name now (the current one and any still in use)."""
        with self._lock:
            return sorted(self._names)

    def close(self) -> None:
        """Stop the server this engine started (if any), delete its temporary adapters and the
        last full weights it wrote."""
        if self.server is not None:
            self.server.stop()
        if self._weights is not None and self._weights.is_relative_to(self.adapter_dir):
            shutil.rmtree(self._weights, ignore_errors=True)
            self._weights = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def _token_id(token: str) -> int:
    """``"token_id:N"`` (``return_tokens_as_token_ids``) -> N."""
    prefix, _, num = token.partition(":")
    if prefix != "token_id" or not num.lstrip("-").isdigit():
        raise EngineError(f"vLLM token {token!r} is not 'token_id:N': the server must honour "
                          "return_tokens_as_token_ids")  # fmt: skip
    return int(num)


def _message(r: requests.Response) -> str:
    try:
        return str(r.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return r.text[:500]
