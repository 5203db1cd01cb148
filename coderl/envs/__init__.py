"""Environments: tasks, the harness that turns them into episodes, and their graders.

- :mod:`coderl.envs.base`: the :class:`Environment` seam, :class:`EpisodeRecord`,
  :class:`GradeRecord` and the failure kinds (what is masked, what is scored);
- :mod:`coderl.envs.toy`: an in-process one-turn task (tests, smoke runs);
- :mod:`coderl.envs.agent`: HumanEval and repository tasks through the agent harness in sandboxes;
- :mod:`coderl.envs.registry`: ``tasks.source`` -> environment (the only dispatch point).
"""

from coderl.envs.base import (
    FAILURE_KINDS,
    Environment,
    EpisodeRecord,
    FailureKind,
    GradeRecord,
    SamplingPolicy,
)
from coderl.envs.registry import ENVIRONMENTS, build_environment
from coderl.envs.toy import ToyEnvironment, ToyTask

__all__ = [
    "ENVIRONMENTS",
    "FAILURE_KINDS",
    "Environment",
    "EpisodeRecord",
    "FailureKind",
    "GradeRecord",
    "SamplingPolicy",
    "ToyEnvironment",
    "ToyTask",
    "build_environment",
]
