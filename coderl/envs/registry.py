"""``ENVIRONMENTS`` maps ``tasks.source`` to a builder; it is the only place a name selects an
environment. The agent-harness environments are imported on use (they pull in the sandbox)."""

from __future__ import annotations

from collections.abc import Callable

from coderl.config import Config
from coderl.envs.base import Environment
from coderl.envs.toy import ToyEnvironment


def _toy(cfg: Config) -> Environment:
    return ToyEnvironment(max_new_tokens=cfg.rollout.max_new_tokens, **cfg.tasks.options)


def _humaneval(cfg: Config) -> Environment:
    from coderl.envs.agent import humaneval_environment

    return humaneval_environment(cfg)


def _repo(cfg: Config) -> Environment:
    from coderl.envs.agent import repo_environment

    return repo_environment(cfg)


# tasks.source -> environment builder; the only dispatch point
ENVIRONMENTS: dict[str, Callable[[Config], Environment]] = {
    "toy": _toy,
    "humaneval": _humaneval,
    "repo": _repo,
}


def build_environment(cfg: Config) -> Environment:
    """The environment named by ``cfg.tasks.source``.

    Raises:
        ValueError: unknown source (lists the valid ones).
    """
    if cfg.tasks.source not in ENVIRONMENTS:
        raise ValueError(
            f"tasks.source: unknown source {cfg.tasks.source!r}; valid: {sorted(ENVIRONMENTS)}"
        )
    return ENVIRONMENTS[cfg.tasks.source](cfg)
