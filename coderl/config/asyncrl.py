"""The ``async`` section, read by ``coderl train-async``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator

from coderl.config._base import ConfigError, _error_message, _Section


class InflightConfig(_Section):
    """In-flight weight updates (AReaL's interruptible rollouts, slime's partial rollouts): a
    running completion picks up newer weights between decode chunks."""

    enabled: bool = False
    """Off: a completion is sampled start to end with the weights it started with. On: after
    every ``chunk_tokens`` sampled tokens the worker loads the newest published weights (if
    newer) and the engine recomputes the KV cache of the context so far under them; every token
    keeps the version that sampled it. Also syncs between turns (as ``weight_sync="turn"``).
    Supported by the local torch engine (``engine.kind=torch``) only."""
    chunk_tokens: int = Field(64, ge=1)
    """Sampled tokens per decode chunk; weights can change only at a chunk boundary."""


class AsyncConfig(_Section):
    """``coderl train-async``: rollout workers decoupled from the trainer, bounded staleness."""

    backend: Literal["local", "ray"] = "local"
    """Where rollout workers run: ``"local"`` (this machine, no extra dependency) or ``"ray"``
    (Ray actors; ``pip install coderl[ray]``)."""
    local_mode: Literal["thread", "process"] = "thread"
    """For ``backend="local"``: ``"thread"`` (workers share the process; right when rollouts wait
    on sandboxes or an inference server) or ``"process"`` (one spawned process per worker; right
    when rollouts burn Python CPU)."""
    num_workers: int = Field(2, ge=1)
    """Rollout workers; each runs one rollout at a time."""
    groups_per_step: int | None = Field(None, ge=1)
    """Complete groups (one task each) consumed by one optimizer step (None:
    ``tasks.tasks_per_step``, as ``coderl train``)."""
    tasks_per_rollout: int | None = Field(None, ge=1)
    """Tasks a worker rolls out together in one batched ``env.rollout`` call, seeded as
    ``coderl train`` seeds a step (None: ``tasks.tasks_per_step``). Must divide
    ``groups_per_step``."""
    max_staleness: int = Field(2, ge=0)
    """A group is trained on only if ``current_version - oldest_version_in_group <= max_staleness``
    (AReaL, Fu et al. 2025, Sec. 5.1). 0 with the default group sizes reproduces ``coderl train``
    exactly (same tasks, samples and weights)."""
    stale_policy: Literal["drop", "resample"] = "drop"
    """What happens to a group that is too stale: ``"drop"`` (counted, its task is not trained on)
    or ``"resample"`` (its task goes back to the front of the queue, counted)."""
    max_resamples: int = Field(3, ge=0, le=100)
    """With ``stale_policy="resample"``: re-samples of one task before it is dropped."""
    weight_sync: Literal["episode", "turn"] = "episode"
    """When workers pick up new weights: ``"episode"`` (before each rollout) or ``"turn"`` (also
    between turns of a running episode; tokens then carry several versions)."""
    inflight: InflightConfig = Field(default_factory=InflightConfig)
    """In-flight weight updates between decode chunks of a running completion."""
    poll_s: float = Field(0.05, gt=0)
    """Longest the trainer blocks waiting for one result before re-checking (seconds)."""
    ray_address: str | None = None
    """For ``backend="ray"`` (and ``trainer.distributed.launcher=ray``): None starts a local
    Ray; ``"auto"`` joins the running cluster; ``"host:6379"`` joins that one;
    ``"ray://host:10001"`` connects a remote client. An explicit address that accepts no TCP
    connection within 5 s is an error (:mod:`coderl.ray_cluster`)."""
    ray_num_cpus: int | None = Field(None, ge=1)
    """CPUs of a locally started Ray (None: all); ignored when joining a cluster."""
    ray_num_graders: int = Field(0, ge=0)
    """For ``backend="ray"``: grader actors separate from rollout workers (0: each worker grades
    its own episodes). Needs a grader factory; the sampler then returns ungraded episodes."""
    ray_worker_cpus: float = Field(1.0, ge=0)
    """CPUs each rollout-worker (and grader) actor reserves in the Ray cluster."""
    ray_worker_gpus: float = Field(0.0, ge=0)
    """GPUs each rollout-worker actor reserves (an inference engine on its own GPU: 1)."""

    @model_validator(mode="after")
    def _check_sizes(self) -> AsyncConfig:
        g, r = self.groups_per_step, self.tasks_per_rollout
        if g is not None and r is not None and g % r:
            raise ValueError(f"async.tasks_per_rollout={r} must divide async.groups_per_step={g}")
        return self

    @property
    def mid_episode_sync(self) -> bool:
        """Whether workers pick up new weights inside a running episode (between turns, and with
        ``inflight.enabled`` also between decode chunks)."""
        return self.weight_sync == "turn" or self.inflight.enabled

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AsyncConfig:
        """Validate a plain dict (an ``async:`` YAML section) alone.

        Raises:
            ConfigError: unknown keys or bad values (naming ``async.<key>``).
        """
        try:
            return cls.model_validate(d)
        except ValidationError as err:
            raise ConfigError(_error_message(err, prefix="async", model=cls)) from None
