"""Auto Install driven by a model: install plans found by agent episodes in the build sandbox.

:class:`ModelBuildPolicy` is a :class:`~coderl.tasks.envbuild.BuildPolicy`. Each ``propose`` runs
one agent episode of any :class:`~coderl.policy.base.Policy` (a model, a remote engine, a
:class:`~coderl.agent.scripted.ScriptedPolicy`) with the harness's tools (``run``, ``read_file``,
``search``, ``edit``, ``write_file``, ``submit``) in a build sandbox over the repository's
snapshot: network on, a fresh virtualenv at ``/venv``. The model explores, runs install commands,
reads their errors and retries, runs the tests, and submits. The install commands that exited 0
(pytest runs excluded) become the plan, which ``build_env`` then *replays* into a fresh
virtualenv and validates like any rule-based plan (tests twice without network, flaky tests
dropped): what the model did in its own sandbox counts only if it reproduces. The next episode's
task names every earlier attempt and its error. After ``episodes`` model attempts the fallback
(the rule-based builder by default) proposes its plans; the model's own attempts stay listed.

For a repository without tests, :func:`write_tests` asks the model to write them (see there): only
tests that pass on the original code, twice, and fail on at least one synthesised bug are kept.

Limits: the whole exploration episode has network (the sandbox cannot switch it per command);
the validation runs do not. The replayed commands are shell text from the model, run in the same
build sandbox the rule-based plans use (no more privilege, but no less either). Commands that
changed state and failed (a half-finished install) are not replayed, so the replay can miss an
effect the episode relied on: the validation then fails and the attempt is recorded.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from coderl.agent.episode import Episode, EpisodeConfig, SimpleTask
from coderl.agent.runner import run_episode
from coderl.policy.base import Policy
from coderl.tasks.detect import InstallPlan, ProjectInfo, detect
from coderl.tasks.envbuild import (
    BUILD_LIMITS,
    BuildPolicy,
    RuleBasedPolicy,
)
from coderl.tasks.runner import SANDBOX_ENV, SandboxFactory, default_factory
from coderl.tasks.snapshot import cache_dir

BUILD_TOOLS = ("run", "read_file", "search", "edit", "write_file", "submit")
"""The tool set of a build episode (task kind ``build``)."""

INSTRUCTIONS = (
    "You set up Python test environments. The repository is at the workspace root and a fresh "
    "virtualenv is at /venv. Install what the tests need into it with "
    "`/venv/bin/python -m pip install ...` (you have network), read any error and try another "
    "command, then run the tests with `/venv/bin/python -m pytest -q`. Every command that "
    "succeeds is recorded and replayed later to rebuild the environment. Call submit when the "
    "tests run."
)


def build_statement(
    info: ProjectInfo, attempts: list[dict[str, Any]], test_paths: list[str]
) -> str:
    """The build task shown to the model: what detection found and what was tried before."""
    facts = [
        f"Build files: {', '.join(info.build_files) or 'none'}.",
        f"Source root: {info.source_root}; packages: {', '.join(info.top_level) or 'none'}.",
        f"Tests: {' '.join(test_paths) or 'none found'}.",
        f"Requirement files: {', '.join(info.requirement_files) or 'none'}.",
    ]
    if info.test_extras:
        facts.append(f"Test extras: {', '.join(info.test_extras)}.")
    if info.test_imports:
        facts.append(f"Third-party imports of the tests: {', '.join(info.test_imports)}.")
    text = "Install this repository's test environment into /venv.\n" + "\n".join(facts)
    for a in attempts:
        cmds = "; ".join(a.get("commands", [])) or "(no command)"
        err = str(a.get("error", "")).strip()[-600:] or "no test passed"
        text += f"\n\nEarlier attempt {a['plan']} ran: {cmds}\nIt stopped at {a['step']}:\n{err}"
    return text


READ_ONLY = frozenset({"ls", "cat", "head", "tail", "find", "grep", "pwd", "which", "wc", "tree"})
"""First words of exploration commands, which are not replayed."""


def _replayed(command: str) -> bool:
    words = command.split()
    if not words or words[0] in READ_ONLY:
        return False
    return not ("pytest" in command and "pip" not in command)  # a test run, not an install


def install_commands(episode: Episode) -> list[str]:
    """The ``run`` commands of ``episode`` that exited 0, in order; test runs and read-only
    exploration (first word in ``READ_ONLY``) left out."""
    out = []
    for call in episode.tool_calls:
        if call.name != "run" or call.status != "ok" or call.arguments is None:
            continue
        command = str(call.arguments.get("command", ""))
        if call.observation.startswith("exit code 0") and _replayed(command):
            out.append(command)
    return out


@dataclass
class ModelBuildPolicy:
    """A :class:`BuildPolicy` whose plans come from agent episodes of ``policy``."""

    policy: Policy
    """Samples the build episodes' turns (its ``tokenizer`` renders the prompts)."""
    episodes: int = 3
    """Model attempts before the fallback takes over."""
    cfg: EpisodeConfig = field(default_factory=lambda: EpisodeConfig(max_turns=20))
    """Limits and sampling of each build episode (its ``toolsets`` gains ``build``)."""
    fallback: BuildPolicy | None = field(default_factory=RuleBasedPolicy)
    """Proposes the plans after the model's attempts; ``None``: give up after them."""
    factory: SandboxFactory | None = None
    """Creates the build sandboxes (default ``coderl.sandbox.Sandbox.create``)."""
    log: list[dict[str, Any]] = field(default_factory=list)
    """One entry per model episode: finish reason, every command run with its status line."""
    _root: Path | None = None

    def explore(self, root: Path) -> ProjectInfo:
        self._root = root
        return detect(root)

    def test_paths(self, info: ProjectInfo) -> list[str]:
        return list(info.test_dirs)

    def propose(self, info: ProjectInfo, attempts: list[dict[str, Any]]) -> InstallPlan | None:
        """The next model plan (an episode is run now), then the fallback's plans."""
        if len(self.log) < self.episodes:
            commands = self._episode(info, attempts)
            return InstallPlan(f"model[{len(self.log) - 1}]", tuple(commands))
        if self.fallback is None:
            return None
        theirs = [a for a in attempts if not str(a["plan"]).startswith("model[")]
        return self.fallback.propose(info, theirs)

    def _episode(self, info: ProjectInfo, attempts: list[dict[str, Any]]) -> list[str]:
        if self._root is None:
            raise RuntimeError("ModelBuildPolicy.propose before explore")
        statement = build_statement(info, attempts, self.test_paths(info))
        task = SimpleTask(f"build/{len(self.log)}", statement, kind="build")
        episode = run_build_episode(self.policy, task, self._root, self.cfg, self.factory)
        commands = install_commands(episode)
        self.log.append(
            {
                "finish": episode.stats.finish_reason,
                "turns": episode.stats.turns,
                "ran": [
                    (str((c.arguments or {}).get("command", "")), c.observation.split("\n")[0])
                    for c in episode.tool_calls
                    if c.name == "run"
                ],
                "install_commands": commands,
            }
        )
        return commands


def run_build_episode(
    policy: Policy,
    task: SimpleTask,
    snapshot: Path,
    cfg: EpisodeConfig,
    factory: SandboxFactory | None = None,
) -> Episode:
    """One build episode in a fresh build sandbox over ``snapshot`` (network on, a scratch
    virtualenv at ``/venv``); the sandbox and the virtualenv are gone when it returns.

    Raises:
        RuntimeError: the scratch virtualenv could not be created (an infrastructure fault).
    """
    factory = factory or default_factory()
    cfg = replace(cfg, instructions=INSTRUCTIONS, toolsets={**cfg.toolsets, "build": BUILD_TOOLS})
    pip_cache = cache_dir() / "pip"
    pip_cache.mkdir(exist_ok=True)
    pip_cache.chmod(0o777)
    venv = Path(tempfile.mkdtemp(dir=cache_dir(), prefix=".model-venv-"))
    venv.chmod(0o777)
    rw = {"/venv": str(venv), "/pipcache": str(pip_cache)}
    env = dict(SANDBOX_ENV, PIP_CACHE_DIR="/pipcache")
    try:
        sb = factory(
            snapshot, limits=BUILD_LIMITS, env=env, ro_mounts={}, rw_mounts=rw, network=True
        )
        try:
            made = sb.exec("/usr/bin/python3 -m venv /venv", timeout=120)
            if made.exit_code != 0:
                raise RuntimeError(f"build sandbox: venv failed: {made.stderr[-500:]}")
            return run_episode(policy, task, sb, cfg)
        finally:
            sb.close()
    finally:
        shutil.rmtree(venv, ignore_errors=True)
