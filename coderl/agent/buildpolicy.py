"""Auto Install driven by a model: install plans found by agent episodes in the build sandbox.

:class:`ModelBuildPolicy` is a :class:`~coderl.envbuild.build.BuildPolicy`; :data:`BUILDERS` names
the build policies ``coderl tasks build-env --builder`` offers (this module sits above the harness it
drives, so the registry that names it lives here too). Each ``propose`` runs
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

import functools
import hashlib
import json
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from coderl.agent.episode import Episode, EpisodeConfig, SimpleTask
from coderl.agent.runner import run_episode
from coderl.envbuild.build import BUILD_LIMITS, BuildPolicy, RuleBasedPolicy
from coderl.envbuild.detect import InstallPlan, ProjectInfo, detect
from coderl.grading.runner import SANDBOX_ENV, SandboxFactory, default_factory
from coderl.policy.base import Policy
from coderl.tasks.env import EnvRecord
from coderl.tasks.patches import apply_patch, make_diff, materialize, split_diff
from coderl.tasks.snapshot import cache_dir, clear_setid

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
    """One entry per model episode: finish reason, turns, every command run with its status
    line, the install commands taken, and the start of each assistant message."""
    _root: Path | None = field(default=None, init=False, repr=False)

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
                "said": [
                    m["content"][:400]
                    for window in episode.transcripts
                    for m in window
                    if m["role"] == "assistant"
                ],
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
        clear_setid(pip_cache)  # written by the sandbox on the host: no set-id bit may stay
        shutil.rmtree(venv, ignore_errors=True)


WRITE_TESTS = (
    "This repository has no tests. Install it and what it needs into /venv, then write pytest "
    "tests for its public functions into files under tests/ (for example "
    "tests/test_written.py), importing the package as its users would. A test is kept only if "
    "it passes on this code and fails when a small bug is put into the code it calls, so test "
    "exact results. Run them with `/venv/bin/python -m pytest -q tests` and call submit when "
    "they pass."
)


@dataclass
class _FirstPlan:
    """Replays one known plan first, then the fallback's plans (a :class:`BuildPolicy`)."""

    plan: InstallPlan
    fallback: BuildPolicy
    _used: bool = field(default=False, init=False)

    def explore(self, root: Path) -> ProjectInfo:
        return detect(root)

    def test_paths(self, info: ProjectInfo) -> list[str]:
        return list(info.test_dirs)

    def propose(self, info: ProjectInfo, attempts: list[dict[str, Any]]) -> InstallPlan | None:
        if not self._used:
            self._used = True
            return self.plan
        return self.fallback.propose(info, [a for a in attempts if a["plan"] != self.plan.name])


def written_test_chunks(diff: str) -> dict[str, str]:
    """Path -> diff chunk of every test file an episode's diff *adds*; changes to other files
    are not taken, so the code under test stays the original."""
    from coderl.envbuild.detect import _is_test_path

    return {
        rel: chunk
        for rel, chunk in split_diff(diff)
        if _is_test_path(rel) and rel.endswith(".py") and "\n--- /dev/null" in chunk
    }


def write_tests(
    spec: str,
    policy: Policy,
    *,
    cfg: EpisodeConfig | None = None,
    max_mutants: int = 12,
    seed: int = 0,
    factory: SandboxFactory | None = None,
    cache: Path | None = None,
) -> EnvRecord:
    """Environment for a repository without tests: the model installs it and writes tests.

    One build episode (:data:`WRITE_TESTS`); the test files it added are put into a copy of the
    snapshot, which is built with the episode's install commands first (then the rules); tests
    that pass twice are the candidates. Up to ``max_mutants`` synthesised bugs
    (:func:`coderl.synth.repo.candidates`: mutants of functions the tests call) are run
    against them: only tests that fail on at least one are kept in ``EnvRecord.passing``; the
    others stay in the files but are never used as FAIL_TO_PASS or PASS_TO_PASS.
    ``info["written_tests"]`` records the files, the kept and dropped tests, the mutants tried.

    Raises:
        BuildError: ``write-tests`` (no test file written, or no written test catches a bug),
            or whatever :func:`build_env` raises for the copy.
    """
    from coderl.envbuild.build import BuildError, build_env, snapshot_or_raise

    cache = cache or cache_dir()
    digest, snapshot = snapshot_or_raise(spec, cache)
    info = detect(snapshot)
    task = SimpleTask(
        "build/write-tests", WRITE_TESTS + "\n\n" + build_statement(info, [], []), "build"
    )
    episode = run_build_episode(policy, task, snapshot, cfg or EpisodeConfig(max_turns=30), factory)
    files = written_test_chunks(episode.diff)
    commands = install_commands(episode)
    if not files:
        raise BuildError(spec, "write-tests", "the model wrote no test file", [])
    derived = _with_tests(spec, digest, snapshot, files, cache)
    first = _FirstPlan(InstallPlan("model[0]", tuple(commands)), RuleBasedPolicy())
    env = build_env(str(derived), factory=factory, cache=cache, build_policy=first)
    if "written_tests" in env.info:  # reused: the filter already ran
        return env
    killed, tried = _tests_catching_bugs(env, max_mutants, seed, factory or default_factory())
    kept = [t for t in env.passing if t in killed]
    dropped = [t for t in env.passing if t not in killed]
    if not kept:
        why = f"none of {len(env.passing)} passing written tests failed on {tried} synthesised bugs"
        raise BuildError(spec, "write-tests", why, env.attempts)
    env.passing = kept
    env.info["written_tests"] = {
        "files": sorted(files),
        "kept": kept,
        "dropped_no_bug_caught": dropped,
        "failing_on_original": list(env.failing),
        "mutants_tried": tried,
    }
    env.save(Path(env.venv).parent / "env.json")
    return env


def _with_tests(spec: str, digest: str, snapshot: Path, files: dict[str, str], cache: Path) -> Path:
    """A content-addressed copy of ``snapshot`` with the written test files (path -> diff
    chunk) applied, under ``<cache>/written``; made once."""
    from coderl.tasks.snapshot import parse_spec

    pinned = parse_spec(spec)
    name = pinned[0] if pinned else Path(spec).resolve().name
    key = hashlib.sha256(json.dumps([digest, sorted(files.items())]).encode()).hexdigest()[:12]
    derived = cache / "written" / key / name
    if not derived.exists():
        staging = Path(tempfile.mkdtemp(dir=cache, prefix=".written-"))
        shutil.copytree(snapshot, staging / name)
        apply_patch(staging / name, "".join(files.values()))
        derived.parent.mkdir(parents=True, exist_ok=True)
        (staging / name).chmod(0o755)
        (staging / name).rename(derived)
        shutil.rmtree(staging, ignore_errors=True)
    return derived


def _tests_catching_bugs(
    env: EnvRecord, max_mutants: int, seed: int, factory: SandboxFactory
) -> tuple[set[str], int]:
    """``(the passing tests that fail on at least one synthesised bug, bugs tried)``: up to
    ``max_mutants`` of :func:`coderl.synth.repo.candidates`, each run against ``env.passing``."""
    import random

    from coderl.synth.repo import _run as run_selected
    from coderl.synth.repo import candidates

    killed: set[str] = set()
    tried = 0
    for cand in candidates(env, random.Random(seed)):
        if tried >= max_mutants:
            break
        tried += 1
        bug = make_diff(cand.path, cand.original, cand.mutant.source)
        run = run_selected(env, materialize(Path(env.snapshot), bug), env.passing, factory, 60.0)
        if not run.results_missing:  # a crashed run tells nothing about single tests
            killed |= {t for t in env.passing if not run.passed(t)}
    return killed, tried


def build_with_model(
    spec: str,
    policy: Policy,
    *,
    cfg: EpisodeConfig | None = None,
    factory: SandboxFactory | None = None,
    cache: Path | None = None,
    **options: Any,
) -> EnvRecord:
    """``build-env --builder model``: :func:`write_tests` when the repository has no tests,
    else :func:`build_env` with a :class:`ModelBuildPolicy` (``options`` go to it)."""
    from coderl.envbuild.build import build_env, snapshot_or_raise

    _, snapshot = snapshot_or_raise(spec, cache or cache_dir())
    if not detect(snapshot).test_dirs:
        return write_tests(spec, policy, cfg=cfg, factory=factory, cache=cache)
    if cfg is not None:
        options["cfg"] = cfg
    builder = ModelBuildPolicy(policy, factory=factory, **options)
    return build_env(spec, factory=factory, cache=cache, build_policy=builder)


@functools.cache
def demo_policy() -> Policy:
    """The demo model (SmolLM2-135M-Instruct), loaded once per process."""
    from coderl.policy import load_policy

    return load_policy("smollm2-135m", reference=False)


def demo_model_builder() -> BuildPolicy:
    """:class:`ModelBuildPolicy` with the demo model (SmolLM2-135M, loaded once per process), the
    rule-based builder as its fallback."""
    return ModelBuildPolicy(demo_policy())


BUILDERS: dict[str, Callable[[], BuildPolicy]] = {
    "rules": RuleBasedPolicy,
    "model": demo_model_builder,
}
"""Builder name -> build policy; the only dispatch point for ``--builder``."""


def get_builder(name: str) -> BuildPolicy:
    """Instantiate a build policy by name. Raises KeyError listing the valid names."""
    if name not in BUILDERS:
        raise KeyError(f"unknown builder {name!r}; valid: {sorted(BUILDERS)}")
    return BUILDERS[name]()


def build_function(name: str) -> Callable[[str], EnvRecord]:
    """spec -> built environment for the builder ``name`` (a key of :data:`BUILDERS`):
    ``rules`` is :func:`build_env`; ``model`` is :func:`build_with_model` with the demo model,
    which also writes tests for a repository without any.

    Raises:
        KeyError: an unknown name (the message lists the valid ones).
    """
    from coderl.envbuild.build import build_env

    if name not in BUILDERS:
        raise KeyError(f"unknown builder {name!r}; valid: {sorted(BUILDERS)}")
    if name == "model":
        return lambda spec: build_with_model(spec, demo_policy())
    return lambda spec: build_env(spec, build_policy=get_builder(name))
