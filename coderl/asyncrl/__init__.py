"""Asynchronous RL: rollout workers decoupled from the trainer, with bounded staleness.

Workers (threads, processes or Ray actors) turn tasks into groups of episodes whose sampled tokens
carry the policy version that produced them; the trainer takes complete groups that pass admission
control (``version - oldest_version <= max_staleness``), corrects for staleness with importance
weights on the stored behaviour logprobs, and publishes new weights under a new version.

Not here: the trainer step itself (a :class:`Learner`), the agent harness and graders (inside a
:class:`Sampler`); the real ones (:mod:`coderl.asyncrl.trainer`) are the pipeline of
``coderl train`` (:mod:`coderl.train.pipeline`). The configuration is the ``async`` section of the
one config tree (:class:`coderl.config.AsyncConfig`). Ray is imported only by the ``ray`` backend.
"""

from coderl.asyncrl.buffer import EpisodeBuffer, TaskLedger, cycle_tasks, job_seed
from coderl.asyncrl.loop import BACKENDS, AsyncRunner, make_backend
from coderl.asyncrl.metrics import AsyncMetrics, logprob_gap
from coderl.asyncrl.types import Episode, Group, Job, Learner, Sampler, Weights
from coderl.asyncrl.weights import FileWeightStore, MemoryWeightStore
from coderl.config import AsyncConfig

__all__ = [
    "BACKENDS",
    "AsyncConfig",
    "AsyncMetrics",
    "AsyncRunner",
    "Episode",
    "EpisodeBuffer",
    "FileWeightStore",
    "Group",
    "Job",
    "Learner",
    "MemoryWeightStore",
    "Sampler",
    "TaskLedger",
    "Weights",
    "cycle_tasks",
    "job_seed",
    "logprob_gap",
    "make_backend",
]
