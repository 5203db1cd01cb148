"""``ENVIRONMENTS`` maps ``tasks.source`` to a builder; it is the only place a name selects an
environment. The agent-harness environments are imported on use (they pull in the sandbox)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

from coderl.config import Config, ConfigError
from coderl.envs.base import Environment
from coderl.envs.toy import ToyEnvironment


def check_options(options: dict[str, Any], valid: Iterable[str], where: str) -> None:
    """Refuse ``tasks.options`` keys a source does not read (a typo would be ignored silently
    or fail mid-rollout).

    Raises:
        ConfigError: an unknown key, named as ``<where>.<key>``, with the valid ones.
    """
    valid = sorted(valid)
    unknown = sorted(set(options) - set(valid))
    if unknown:
        names = ", ".join(repr(f"{where}.{k}") for k in unknown)
        raise ConfigError(f"unknown key {names}; valid: {valid}")


def _episode_keys() -> list[str]:
    """The harness's ``EpisodeConfig`` fields that ``tasks.options.episode`` may set (the others
    come from ``rollout.*``, see ``AgentEnvironment.episode_config``)."""
    from coderl.agent.episode import EpisodeConfig

    from_rollout = {"max_turns", "max_tokens", "max_tokens_per_turn", "context_budget"}
    from_rollout |= {"temperature", "top_p", "seed"}
    from_rollout.add("potential")  # a function the environment sets, never YAML
    return [f.name for f in dataclasses.fields(EpisodeConfig) if f.name not in from_rollout]


def check_toolset(toolsets: Any, kind: str, key: str = "tasks.options.episode.toolsets") -> None:
    """Refuse a ``tasks.options.episode.toolsets`` that gives the source's task kind no tool set,
    or names a tool that does not exist (either would fail in every episode, after the model
    loaded).

    Args:
        toolsets: the configured ``{task kind: [tool name, ...]}``, or None (the default
            ``coderl.agent.tools.TOOLSETS``, which covers every kind).
        kind: the kind of the source's tasks (``repo`` or ``function``).
        key: where ``toolsets`` was set (the message names it).

    Raises:
        ConfigError: one line naming the key and what to set.
    """
    from coderl.agent.tools import TOOLSETS, resolve_tools

    if toolsets is None:
        return
    if kind not in toolsets:
        default = "[" + ", ".join(TOOLSETS[kind]) + "]"
        raise ConfigError(
            f"{key} has no tool set for this source's {kind!r} tasks (it has {sorted(toolsets)}): "
            f"add {key}.{kind}={default}, or leave {key} unset for the default tool sets"
        )
    for name, tools in toolsets.items():
        try:
            resolve_tools(list(tools))
        except KeyError as e:
            raise ConfigError(f"{key}.{name}: {e.args[0]}") from None


def _check_agent_options(cfg: Config, top: set[str], kind: str) -> None:
    check_options(cfg.tasks.options, top, "tasks.options")
    episode = cfg.tasks.options.get("episode") or {}
    check_options(episode, _episode_keys(), "tasks.options.episode")
    check_toolset(episode.get("toolsets"), kind)


def _toy(cfg: Config) -> Environment:
    valid = [f.name for f in dataclasses.fields(ToyEnvironment) if f.init and f.name[0] != "_"]
    check_options(cfg.tasks.options, set(valid) - {"max_new_tokens"}, "tasks.options")
    return ToyEnvironment(max_new_tokens=cfg.rollout.max_new_tokens, **cfg.tasks.options)


def _humaneval(cfg: Config) -> Environment:
    from coderl.envs.agent import humaneval_environment

    _check_agent_options(cfg, {"episode"}, "function")
    return humaneval_environment(cfg)


def _fnrepair(cfg: Config) -> Environment:
    from coderl.envs.fnrepair import fnrepair_environment

    _check_agent_options(cfg, {"episode", "tasks_file", "outside_file"}, "function")
    return fnrepair_environment(cfg)


def _repo(cfg: Config) -> Environment:
    from coderl.envs.agent import repo_environment

    _check_agent_options(cfg, {"episode", "tasks_file", "repos_file", "ladder"}, "repo")
    return repo_environment(cfg)


def _swebench(cfg: Config) -> Environment:
    from coderl.envs.agent import swebench_environment

    _check_agent_options(cfg, {"episode", "tasks_file", "split", "namespace"}, "repo")
    if not cfg.tasks.options.get("tasks_file"):
        raise ConfigError("tasks.options.tasks_file: the SWE-bench-format instances to read")
    if cfg.sandbox.backend != "container":
        raise ConfigError(
            "tasks.source=swebench runs every episode in its instance's image: "
            "set sandbox.backend=container"
        )
    if cfg.sft.enabled:  # coderl.agent.oracle replays gold patches in coderl-built environments
        raise ConfigError(
            "tasks.source=swebench has no SFT warm start (the oracle needs environments coderl "
            "built): set sft.enabled=false"
        )
    return swebench_environment(cfg)


def _gateway(cfg: Config) -> Environment:
    from coderl.envs.gateway import (
        GATEWAY_KEYS,
        GatewayEnvironment,
        GatewayOptions,
        check_program,
    )

    opts = dict(cfg.tasks.options)
    if not opts.get("program"):
        raise ConfigError(
            "tasks.options.program: the gateway needs the command that runs the agent program "
            "(docs/harness-byo.md)"
        )
    inner = opts.get("inner", "fnrepair")
    if inner not in ("fnrepair", "humaneval", "repo"):
        raise ConfigError(
            f"tasks.options.inner: {inner!r}; valid: ['fnrepair', 'humaneval', 'repo']"
        )
    check_options(opts, GATEWAY_KEYS | {"episode", "tasks_file", "repos_file"}, "tasks.options")
    check_program(str(opts["program"]))  # before the model loads
    mine = {k: opts.pop(k) for k in list(opts) if k in GATEWAY_KEYS}
    tasks = cfg.tasks.model_copy(update={"source": inner, "options": opts})
    env = ENVIRONMENTS[inner](cfg.model_copy(update={"tasks": tasks}))
    return GatewayEnvironment(cfg, env, GatewayOptions(**mine))  # type: ignore[arg-type]


def _mix(cfg: Config) -> Environment:
    from coderl.envs.mix import MixEnvironment

    t = cfg.tasks
    envs, splits = {}, {}
    for m in t.mix:
        tasks = t.model_copy(update={"source": m.source, "options": m.options, "mix": []})
        envs[m.label()] = build_environment(cfg.model_copy(update={"tasks": tasks}))
        splits[m.label()] = (m.split or t.train_split, m.heldout_split or t.heldout_split)
    return MixEnvironment(envs, splits, t.train_split, t.heldout_split)


# tasks.source -> environment builder; the only dispatch point
ENVIRONMENTS: dict[str, Callable[[Config], Environment]] = {
    "toy": _toy,
    "humaneval": _humaneval,
    "repo": _repo,
    "swebench": _swebench,
    "fnrepair": _fnrepair,
    "gateway": _gateway,
    "mix": _mix,
}


def check_built(env: Environment, split: str, limit: int | None = None) -> None:
    """Refuse, before the model loads, the first ``limit`` tasks of ``split`` (all: None) whose
    repository environment is not built (:func:`coderl.tasks.env.check_built`); through a
    gateway, and in each entry of a mix. Instance images (``tasks.source=swebench``) bring their
    own environment and are not checked.

    Raises:
        ValueError: one line naming the missing environments and the build command.
    """
    from coderl.envs.mix import MixEnvironment
    from coderl.tasks.env import check_built as check_tasks

    if isinstance(env, MixEnvironment):
        for label, sub in env.envs.items():
            if _own_sandboxes(getattr(sub, "inner", sub)):
                check_tasks(env.source_tasks(label, split))
        return
    inner = getattr(env, "inner", env)  # a gateway runs its inner environment's sandboxes
    if _own_sandboxes(inner):
        check_tasks(inner.tasks(split)[:limit])


def _own_sandboxes(env: Any) -> bool:
    """``env`` starts its rollouts in coderl-built environments (not in instance images)."""
    from coderl.envs.agent import AgentEnvironment

    return isinstance(env, AgentEnvironment) and env.sandbox is None


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
