"""Configuration of asynchronous RL: one dataclass, each field documented once under the field.

A training config includes it as its ``async`` section (``AsyncConfig.from_dict``); unknown keys
and bad values raise with the valid choices listed.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

BACKEND_NAMES = ("local", "ray")
LOCAL_MODES = ("thread", "process")
STALE_POLICIES = ("drop", "resample")
WEIGHT_SYNC = ("episode", "turn")


@dataclass
class AsyncConfig:
    backend: str = "local"
    """Where rollout workers run: ``"local"`` (this machine, no extra dependency) or ``"ray"``
    (Ray actors; ``pip install coderl[ray]``)."""
    local_mode: str = "thread"
    """For ``backend="local"``: ``"thread"`` (workers share the process; right when rollouts wait
    on sandboxes or an inference server) or ``"process"`` (one spawned process per worker; right
    when rollouts burn Python CPU)."""
    num_workers: int = 2
    """Rollout workers; each runs one group at a time."""
    groups_per_step: int = 4
    """Complete groups (one task each) consumed by one optimizer step."""
    max_staleness: int = 2
    """A group is trained on only if ``current_version - oldest_version_in_group <= max_staleness``
    (AReaL, Fu et al. 2025, Sec. 5.1). 0 reproduces the synchronous loop exactly."""
    stale_policy: str = "drop"
    """What happens to a group that is too stale: ``"drop"`` (counted, its task is not trained on)
    or ``"resample"`` (its task goes back to the front of the queue, counted)."""
    max_resamples: int = 3
    """With ``stale_policy="resample"``: re-samples of one task before it is dropped."""
    weight_sync: str = "episode"
    """When workers pick up new weights: ``"episode"`` (before each group) or ``"turn"`` (also
    between turns of a running episode; tokens then carry several versions)."""
    seed: int = 0
    """Run seed; each job's sampling seed derives from (seed, task index, attempt)."""
    poll_s: float = 0.05
    """Longest the trainer blocks waiting for one result before re-checking (seconds)."""
    ray_address: str | None = None
    """For ``backend="ray"``: None starts a local Ray; ``"auto"`` joins the running cluster;
    ``"ray://host:10001"`` connects a remote client."""
    ray_num_cpus: int | None = None
    """CPUs of a locally started Ray (None: all); ignored when joining a cluster."""
    ray_num_graders: int = 0
    """For ``backend="ray"``: grader actors separate from rollout workers (0: each worker grades
    its own episodes). Needs a grader factory; the sampler then returns ungraded episodes."""
    ray_worker_cpus: float = 1.0
    """CPUs each rollout-worker (and grader) actor reserves in the Ray cluster."""
    ray_worker_gpus: float = 0.0
    """GPUs each rollout-worker actor reserves (an inference engine on its own GPU: 1)."""

    def __post_init__(self) -> None:
        choices = {
            "backend": BACKEND_NAMES,
            "local_mode": LOCAL_MODES,
            "stale_policy": STALE_POLICIES,
            "weight_sync": WEIGHT_SYNC,
        }
        for name, valid in choices.items():
            if getattr(self, name) not in valid:
                raise ValueError(f"async.{name}={getattr(self, name)!r}; valid: {list(valid)}")
        for name in ("num_workers", "groups_per_step"):
            if getattr(self, name) < 1:
                raise ValueError(f"async.{name} must be >= 1, got {getattr(self, name)}")
        for name in (
            "max_staleness",
            "max_resamples",
            "ray_num_graders",
            "ray_worker_cpus",
            "ray_worker_gpus",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"async.{name} must be >= 0, got {getattr(self, name)}")
        if self.poll_s <= 0:
            raise ValueError(f"async.poll_s must be > 0, got {self.poll_s}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AsyncConfig:
        """Build from a plain dict (a YAML section).

        Raises:
            ValueError: an unknown key (lists the valid ones) or a bad value.
        """
        valid = [f.name for f in fields(cls)]
        unknown = sorted(set(d) - set(valid))
        if unknown:
            raise ValueError(f"unknown async keys {unknown}; valid: {valid}")
        return cls(**d)
