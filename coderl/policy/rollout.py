"""What rollouts sample from: :func:`build_engine` turns ``cfg.engine`` and the loaded policy into a
:class:`RolloutEngine`, the object environments call (``generate`` + ``version``, the
:class:`coderl.envs.base.SamplingPolicy` protocol) plus ``sync`` after every optimizer step and
``close`` at the end.

``ENGINES`` maps ``engine.kind`` to a builder; it is the only place a name selects one:

- ``torch``: the policy's own in-process sampler; ``sync`` has nothing to do (it reads the live
  weights, or with ``engine.dtype`` bf16 a bf16 copy that takes them up before each call);
- ``vllm``: a vLLM server (started from ``.venv-vllm`` unless ``engine.url`` names one), weights
  synced as versioned LoRA adapters, or with full fine-tuning as whole weights reloaded in the
  server (:mod:`coderl.policy.vllm_reload`), and checked by the canary
  (:mod:`coderl.policy.vllm_engine`).

The loop's contract, for either kind::

    engine = build_engine(cfg, policy)       # vllm: server up, version policy.version synced
    ... env.rollout(engine, tasks, params, G) ...
    optimizer.step(); policy.bump_version()
    engine.sync(policy)                      # vllm: adapter (or weights) saved, loaded, canary-checked
    ...
    engine.close()                           # vllm: server stopped, no process left

``generate`` refuses to sample when the policy has moved past the engine's version (a sync was
skipped), so a run never trains on rollouts it believes are newer than they are.

Two more users of the same engine: ``coderl train-async`` hands each thread worker
``engine.pinned()`` (:class:`PinnedVersion`, it samples the version it holds while the learner
syncs newer ones), and ``coderl serve`` calls ``engine.retarget(policy)`` to serve a new champion
from the same server.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from coderl.config import Config
from coderl.policy.base import Completion, SamplingParams
from coderl.policy.local import LocalPolicy
from coderl.policy.precision import resolve_precision


class StaleEngineError(RuntimeError):
    """The policy took an optimizer step but the engine was not synced."""


class RolloutEngine(Protocol):
    """What the loop holds: a :class:`~coderl.envs.base.SamplingPolicy` that can be synced."""

    @property
    def version(self) -> int: ...  # the weight version ``generate`` samples with

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]: ...
    def sync(self, policy: LocalPolicy) -> dict[str, float]: ...
    def retarget(self, policy: LocalPolicy) -> dict[str, float]: ...
    def close(self) -> None: ...


class TorchRollout:
    """The policy's own sampler behind the :class:`RolloutEngine` interface."""

    def __init__(self, policy: LocalPolicy):
        self.policy = policy
        self.tokenizer = policy.tokenizer

    @property
    def version(self) -> int:
        return self.policy.version

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        return self.policy.generate(prompts, params)

    def forget_prefixes(self, sequences: list[list[int]]) -> int:
        """Drop an ended episode's cached KV (:meth:`LocalPolicy.forget_prefixes`)."""
        return self.policy.forget_prefixes(sequences)

    def prefill_counters(self) -> dict[str, int]:
        """The sampler's running totals of prefilled, reused and prompt tokens
        (:attr:`coderl.policy.engine.TorchEngine.prefill_stats`)."""
        return dict(self.policy.engine.prefill_stats)

    def sync(self, policy: LocalPolicy) -> dict[str, float]:
        """Nothing to move: the sampler reads the live weights. Returns no metric."""
        return {}

    def retarget(self, policy: LocalPolicy) -> dict[str, float]:
        """Sample from another policy from now on (``coderl serve`` loading a new champion)."""
        self.policy, self.tokenizer = policy, policy.tokenizer
        return {}

    def close(self) -> None:
        pass


class VLLMRollout:
    """A :class:`~coderl.policy.vllm_engine.VLLMEngine` serving ``policy``'s synced versions."""

    def __init__(self, policy: LocalPolicy, engine: Any, *, cleanup: tuple[Path, ...] = ()):
        self.policy = policy
        self.engine = engine
        self.tokenizer = policy.tokenizer
        self.cleanup = cleanup  # directories deleted by close (the served model's copy)
        self.sync(policy)

    @property
    def version(self) -> int:
        v = self.engine.version
        assert v is not None  # synced in __init__
        return int(v)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """Sample with the latest synced weights.

        Raises:
            StaleEngineError: the policy's version is ahead of the engine's (``sync`` skipped).
        """
        if self.policy.version != self.engine.version:
            raise StaleEngineError(
                f"the policy is at version {self.policy.version} but the vLLM engine serves "
                f"version {self.engine.version}: call engine.sync(policy) after every optimizer "
                "step"
            )
        return list(self.engine.generate(prompts, params))

    def sync(self, policy: LocalPolicy) -> dict[str, float]:
        """Push ``policy``'s weights and run the canary; returns ``{"engine/canary_gap": ...}``.

        Raises:
            coderl.policy.vllm_engine.CanaryError: the engine serves other weights.
        """
        return {"engine/canary_gap": float(self.engine.sync(policy))}

    def retarget(self, policy: LocalPolicy) -> dict[str, float]:
        """Serve another policy (same base model) from now on: its adapter is synced under its
        version, canary-checked (``coderl serve`` loading a new champion).

        Raises:
            coderl.policy.vllm_engine.CanaryError: the engine serves other weights.
        """
        metrics = self.sync(policy)
        self.policy, self.tokenizer = policy, policy.tokenizer
        return metrics

    def pinned(self) -> PinnedVersion:
        """A client that samples a version it holds, for a rollout worker of ``coderl
        train-async`` (the learner keeps syncing this engine; workers share its server)."""
        return PinnedVersion(self.engine)

    def close(self) -> None:
        """Stop the server this engine started (if any) and delete what it wrote."""
        self.engine.close()
        for path in self.cleanup:
            shutil.rmtree(path, ignore_errors=True)


class PinnedVersion:
    """One async worker's view of a shared vLLM engine: it samples the version it was last
    :meth:`load`-ed with, held so that the learner's later syncs do not unload it mid-episode.

    The workers of one run share this engine's server and its continuous batching: requests of
    every worker (and every turn) are batched together by vLLM, not only within a group.
    """

    def __init__(self, engine: Any):
        self.engine = engine
        self._held: int | None = None

    @property
    def version(self) -> int:
        if self._held is None:
            raise LookupError("no version loaded")
        return self._held

    def load(self, version: int) -> int:
        """Hold ``version`` (or a newer one, see ``VLLMEngine.hold``), release the previous one;
        returns the version now held (tokens sampled from now on carry it)."""
        held = self.engine.hold(version)
        previous, self._held = self._held, held
        if previous is not None:
            self.engine.release(previous)
        return held

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        return list(self.engine.generate(prompts, params, version=self.version))

    def close(self) -> None:
        """Release the held version (the server belongs to the learner's engine)."""
        if self._held is not None:
            self.engine.release(self._held)
            self._held = None


def _torch(cfg: Config, policy: LocalPolicy, training: bool) -> RolloutEngine:
    policy.set_prefix_cache(cfg.engine.prefix_cache_mib)
    policy.set_sampler_precision(cfg.engine.dtype)
    return TorchRollout(policy)


def _vllm(cfg: Config, policy: LocalPolicy, training: bool) -> RolloutEngine:
    from coderl.policy.vllm_engine import VLLMEngine
    from coderl.policy.vllm_server import VLLMServer, write_base_model

    e = cfg.engine
    dtype = str(resolve_precision(e.dtype, policy.device)).removeprefix("torch.")
    full_sync = training and not policy.is_lora  # every weight reloaded in the server
    work = Path(cfg.run_dir) / "vllm"
    work.mkdir(parents=True, exist_ok=True)
    server = None
    url = e.url
    cleanup: tuple[Path, ...] = ()
    if url is None:
        model_dir = write_base_model(
            policy, tempfile.mkdtemp(prefix="model-", dir=work), untie=full_sync
        )
        cleanup = (model_dir,)
        server = VLLMServer(
            model_dir,
            work / "server.log",
            python=e.python,
            dtype=dtype,
            max_model_len=e.max_model_len,
            max_lora_rank=policy.lora.rank if policy.lora else None,
            max_loras=e.max_loras,
            kv_cache_gib=e.kv_cache_gib,
            served_name=e.served_name,
            prefix_caching=e.prefix_caching,
            dev_mode=full_sync,
        ).start(e.ready_timeout_s)
        url = server.url
    try:
        engine = VLLMEngine(
            url,
            policy.eos_token_ids,
            served_name=e.served_name,
            canary_max_gap=e.canary_gap(dtype),
            adapter_dir=work / "adapters",
            server=server,
            timeout_s=e.request_timeout_s,
            full_sync=full_sync,
        )
        return VLLMRollout(policy, engine, cleanup=cleanup)
    except BaseException:
        if server is not None:
            server.stop()
        for path in cleanup:
            shutil.rmtree(path, ignore_errors=True)
        raise


# engine.kind -> builder(cfg, policy); the only dispatch point
ENGINES: dict[str, Callable[[Config, LocalPolicy, bool], RolloutEngine]] = {
    "torch": _torch,
    "vllm": _vllm,
}


def build_engine(cfg: Config, policy: LocalPolicy, *, training: bool = True) -> RolloutEngine:
    """The rollout engine of ``cfg.engine`` over ``policy`` (see the module docstring).

    Args:
        training: the policy will be updated: with full fine-tuning on ``vllm`` the server then
            runs with its development endpoints and every sync reloads all weights (False for
            evaluation or serving only: a fully fine-tuned policy is served as the server
            started).

    Raises:
        ValueError: unknown ``engine.kind`` (lists the valid ones).
        coderl.policy.vllm_server.ServerError: the server did not become ready (its last log
            lines); FileNotFoundError: no vLLM virtualenv.
        coderl.policy.vllm_engine.CanaryError: the first sync already disagrees.
    """
    if cfg.engine.kind not in ENGINES:
        raise ValueError(f"engine.kind: unknown {cfg.engine.kind!r}; valid: {sorted(ENGINES)}")
    return ENGINES[cfg.engine.kind](cfg, policy, training)
