"""Environments from real repositories: snapshot, install, find the passing tests.

``build_env("toolz==1.0.0")`` downloads the sdist (or takes a local directory), unpacks it into a
content-addressed read-only snapshot, detects the build and test setup, and tries install plans
in a sandbox (network allowed for installs) until the test suite runs. The test suite then runs
twice in a sandbox without network; tests that pass both times are recorded, tests that changed
outcome are dropped as flaky. The result, an :class:`EnvRecord`, points at one virtualenv that
every rollout and grading run on that repository mounts read-only at ``/venv``.

The project itself is installed (to pull in its dependencies) and then uninstalled; a ``.pth``
file in the virtualenv puts the workspace's source root (``/testbed`` or ``/testbed/src``) on
``sys.path`` after site-packages, so the code under test is always the workspace copy.

Not bounded: the install sandbox (the repository's own build, network on) writes the virtualenv
and the pip cache to host directories, whose size ``Limits.disk_bytes`` does not cover; set-id
bits it leaves there are cleared afterwards (``snapshot.clear_setid``). Test runs have no
writable host mount.

The steps are pluggable through :class:`BuildPolicy` (explore, propose the next install plan,
choose test paths); the rule-based one is the default, and ``coderl.agent.buildpolicy.BUILDERS``
maps names to policies (the model-driven builder drives the agent harness, so it lives above it).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import shlex
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import asdict
from email.parser import Parser
from pathlib import Path
from typing import Any, Protocol

from coderl.envbuild.detect import InstallPlan, ProjectInfo, detect, propose_install_plans
from coderl.envbuild.exposure import ExposureError, check_readable
from coderl.grading.pytestcfg import run_config
from coderl.grading.runner import (
    RUN_OUTPUT_BYTES,
    SANDBOX_ENV,
    SITE,
    SandboxFactory,
    TestRun,
    conftests_of,
    default_factory,
    mounts,
    run_dirs,
    run_pytest,
)
from coderl.sandbox.base import Limits
from coderl.tasks.env import EnvRecord
from coderl.tasks.snapshot import cache_dir, clear_setid, parse_spec, snapshot_spec

BUILD_LIMITS = Limits(timeout_s=900.0, cpu_s=900, memory_bytes=4 * 1024**3)
TEST_LIMITS = Limits(
    timeout_s=600.0, cpu_s=600, memory_bytes=4 * 1024**3, output_bytes=RUN_OUTPUT_BYTES
)


class BuildError(RuntimeError):
    """A repository could not be built: which ``step`` failed and why (``attempts`` logged)."""

    def __init__(
        self, spec: str, step: str, error: str, attempts: list[dict[str, Any]] | None = None
    ):
        self.spec, self.step, self.error = spec, step, error
        self.attempts = attempts or []
        tried = "".join(
            f"\n  attempt {i + 1}: {a.get('plan')}: stopped at {a.get('step')}"
            for i, a in enumerate(self.attempts)
        )
        super().__init__(f"{spec}: {step} failed: {error}{tried}")


class BuildPolicy(Protocol):
    """The pluggable steps of environment building; a model-driven policy can replace these."""

    def explore(self, root: Path) -> ProjectInfo: ...

    def propose(self, info: ProjectInfo, attempts: list[dict[str, Any]]) -> InstallPlan | None:
        """The next plan to try given the attempts so far, or ``None`` to give up."""
        ...

    def test_paths(self, info: ProjectInfo) -> list[str]: ...


class RuleBasedPolicy:
    """Default policy: :func:`detect`, then :func:`propose_install_plans` in order."""

    def __init__(self, max_attempts: int = 10) -> None:
        self.max_attempts = max_attempts

    def explore(self, root: Path) -> ProjectInfo:
        return detect(root)

    def propose(self, info: ProjectInfo, attempts: list[dict[str, Any]]) -> InstallPlan | None:
        plans = propose_install_plans(info, max_plans=self.max_attempts)
        tried = {a["plan"] for a in attempts}
        return next((p for p in plans if p.name not in tried), None)

    def test_paths(self, info: ProjectInfo) -> list[str]:
        return list(info.test_dirs)


def read_license(root: Path) -> str:
    """Licence from PKG-INFO (``License-Expression``, ``License``, or a licence classifier)."""
    pkg_info = root / "PKG-INFO"
    if not pkg_info.exists():
        return "unknown"
    meta = Parser().parsestr(pkg_info.read_text(encoding="utf-8", errors="replace"))
    for key in ("License-Expression", "License"):
        value = (meta.get(key) or "").strip()
        if value and value.upper() != "UNKNOWN" and len(value) < 80:
            return value
    for c in meta.get_all("Classifier") or []:
        if c.startswith("License ::"):
            return c.split("::")[-1].strip()
    return "unknown"


def _project_name(root: Path, fallback: str) -> str:
    pkg_info = root / "PKG-INFO"
    if pkg_info.exists():
        meta = Parser().parsestr(pkg_info.read_text(encoding="utf-8", errors="replace"))
        if meta.get("Name"):
            return str(meta["Name"])
    return fallback


_INSTALLED = """
import importlib.metadata as m, sys
try:
    d = m.distribution(sys.argv[1])
except m.PackageNotFoundError:  # a plan that installs only the test dependencies
    sys.exit(0)
names = set((d.read_text("top_level.txt") or "").split())
for f in d.files or []:
    top = f.parts[0]
    if len(f.parts) > 1 and not top.endswith((".dist-info", ".egg-info", "..")):
        names.add(top)
    elif f.suffix == ".py":
        names.add(f.stem)
print(" ".join(sorted(n for n in names if n.isidentifier())))
"""
"""Prints the importable top-level names that distribution ``argv[1]`` installed (its
``top_level.txt`` and the first component of each installed file)."""


def _install(
    factory: SandboxFactory,
    snapshot: Path,
    venv: Path,
    plan: InstallPlan,
    info: ProjectInfo,
    dist: str,
) -> tuple[str, str]:
    """Run one install plan into a fresh ``venv``; returns ``(step, error)`` (``("", "")`` = ok)."""
    if venv.exists():
        shutil.rmtree(venv)
    venv.mkdir(parents=True)
    venv.chmod(0o777)
    pip_cache = cache_dir() / "pip"
    pip_cache.mkdir(exist_ok=True)
    pip_cache.chmod(0o777)
    env = dict(SANDBOX_ENV, PIP_CACHE_DIR="/pipcache")
    rw = {"/venv": str(venv), "/pipcache": str(pip_cache)}
    sb = factory(snapshot, limits=BUILD_LIMITS, env=env, ro_mounts={}, rw_mounts=rw, network=True)
    try:
        src = "/testbed" if info.source_root == "." else f"/testbed/{info.source_root}"
        steps = [("venv", "/usr/bin/python3 -m venv /venv")]
        # build from a scratch copy: in-tree builds write egg-info and build/ next to the sources
        steps += [("copy", "rm -rf /tmp/src && cp -r /testbed /tmp/src && chmod -R u+w /tmp/src")]
        steps += [(f"install[{i}]", f"cd /tmp/src && {c}") for i, c in enumerate(plan.commands)]
        steps += [("installed", f"/venv/bin/python -c {shlex.quote(_INSTALLED)} {dist}")]
        steps += [("uninstall-project", f"/venv/bin/python -m pip uninstall -y -q {dist} || true")]
        steps += [("pth", f"echo {src} > {SITE}/coderl_testbed.pth")]
        installed: set[str] = set()
        for step, cmd in steps:
            res = sb.exec(cmd, timeout=BUILD_LIMITS.timeout_s)
            if res.exit_code != 0:
                return step, (res.stderr or res.stdout)[-1500:]
            if step == "installed":
                installed = set(res.stdout.split())
        # only what the distribution installs: a root script of the sdist (a benchmark, an
        # example, docs' conf.py) that imports an optional dependency is not part of it
        for name in [n for n in info.top_level if n in installed] or info.top_level:
            check = f"import {name}, sys; assert {name}.__file__.startswith('/testbed'), {name}.__file__"
            res = sb.exec(f'cd /tmp && /venv/bin/python -c "{check}"', timeout=60)
            if res.exit_code != 0:
                return f"import {name}", (res.stderr or res.stdout)[-1500:]
        return "", ""
    finally:
        sb.close()
        clear_setid(venv)  # written by the sandbox on the host: no set-id bit may stay
        clear_setid(pip_cache)


def _test(
    factory: SandboxFactory,
    base: Path,
    venv: Path,
    paths: list[str],
    trace: bool,
    inifile: str | None = None,
) -> TestRun:
    with run_dirs() as inp:
        ro = mounts(inp, venv)
        sb = factory(
            base, limits=TEST_LIMITS, env=SANDBOX_ENV, ro_mounts=ro, rw_mounts={}, network=False
        )
        try:
            return run_pytest(
                sb,
                inp,
                paths=paths,
                trace=trace,
                timeout=TEST_LIMITS.timeout_s,
                inifile=run_config(base, inifile, paths),
                allowed_conftests=conftests_of(base),
            )
        finally:
            sb.close()


def _env_id(name: str, version: str, digest: str, commands: tuple[str, ...]) -> str:
    key = "\0".join([digest, *commands, "python3.11"])
    h = hashlib.sha256(key.encode()).hexdigest()
    return f"{name}-{version}-{h[:12]}"


def _test_error(run: TestRun, n_pass: int) -> str:
    """What went wrong in a test run: collection errors, else pytest's own last lines (its
    stderr; stdout is the signed verdict stream)."""
    if run.collect_errors:
        return "; ".join(run.collect_errors)[-1500:]
    if n_pass or run.exec is None:
        return ""
    return run.exec.stderr.strip()[-1500:] or f"exit {run.exec.exit_code}"


def _attempt_builds(
    factory: SandboxFactory,
    policy: BuildPolicy,
    snapshot: Path,
    info: ProjectInfo,
    dist: str,
    work: Path,
    spec: str,
) -> tuple[InstallPlan, Path, TestRun, list[dict[str, Any]]]:
    attempts: list[dict[str, Any]] = []
    best: tuple[int, InstallPlan, Path, TestRun] | None = None
    paths = policy.test_paths(info)
    if not paths:
        raise BuildError(spec, "explore", "no test directory or test file found")
    while (plan := policy.propose(info, attempts)) is not None:
        venv = work / f"venv-{len(attempts)}"
        step, error = _install(factory, snapshot, venv, plan, info, dist)
        if step:
            attempts.append(
                {"plan": plan.name, "commands": list(plan.commands), "step": step, "error": error}
            )
            shutil.rmtree(venv, ignore_errors=True)
            continue
        run = _test(factory, snapshot, venv, paths, trace=True, inifile=info.pytest_config)
        n_pass = sum(o == "passed" for o in run.outcomes.values())
        attempts.append(
            {
                "plan": plan.name,
                "commands": list(plan.commands),
                "step": "test",
                "passed": n_pass,
                "collect_errors": len(run.collect_errors),
                "error": _test_error(run, n_pass),
            }
        )
        if n_pass and (best is None or n_pass > best[0]):
            if best is not None:
                shutil.rmtree(best[2], ignore_errors=True)
            best = (n_pass, plan, venv, run)
        else:
            shutil.rmtree(venv, ignore_errors=True)
        if n_pass and not run.collect_errors:
            break
    if best is None:
        last = attempts[-1] if attempts else {"step": "propose", "error": "no install plan"}
        raise BuildError(
            spec, str(last["step"]), str(last.get("error", "")) or "no test passed", attempts
        )
    return best[1], best[2], best[3], attempts


def snapshot_or_raise(spec: str, cache: Path) -> tuple[str, Path]:
    """``snapshot.snapshot_spec``: ``(digest, snapshot directory)`` of ``spec``.

    Raises:
        BuildError: step ``download``, with why the snapshot could not be made.
    """
    try:
        return snapshot_spec(spec, cache=cache)
    except (RuntimeError, FileNotFoundError, OSError) as e:
        raise BuildError(spec, "download", str(e)) from e


def build_env(
    spec: str,
    *,
    factory: SandboxFactory | None = None,
    cache: Path | None = None,
    build_policy: BuildPolicy | None = None,
) -> EnvRecord:
    """Build (or reuse) the environment for ``spec`` (``NAME==VERSION`` or a local directory).

    ``build_policy`` proposes the install plans (default :class:`RuleBasedPolicy`; the named
    builders, the model-driven one included, are ``coderl.agent.buildpolicy.BUILDERS``).

    Raises:
        BuildError: naming the failing step (download, explore, venv, install[i], import X, test)
            and the error tail; ``attempts`` holds every plan tried.
    """
    cache = cache or cache_dir()
    found = _built(spec, cache)
    if found is not None:
        return found
    with _build_lock(spec, cache):  # one build of a spec at a time, across processes
        found = _built(spec, cache)  # built by another process while this one waited
        return found if found is not None else _build(spec, factory, cache, build_policy)


def _built(spec: str, cache: Path) -> EnvRecord | None:
    for existing in sorted((cache / "envs").glob("*/env.json")):
        record = EnvRecord.load(existing)
        if record.spec == spec and Path(record.venv).is_dir():
            return record
    return None


@contextlib.contextmanager
def _build_lock(spec: str, cache: Path) -> Iterator[None]:
    """Hold ``spec``'s build lock: an ``flock`` on ``CACHE/.locks/build-<sha256(spec)>.lock``.

    Two processes building one spec (two pytest-xdist workers on a fresh cache) would otherwise
    both build it and the second's rename onto the first's ``venv`` fails. The kernel drops the
    lock when its holder exits however it exits, so a killed build never leaves it stuck."""
    locks = cache / ".locks"
    locks.mkdir(parents=True, exist_ok=True)
    name = hashlib.sha256(spec.encode()).hexdigest()[:16]
    with open(locks / f"build-{name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _build(
    spec: str,
    factory: SandboxFactory | None,
    cache: Path,
    build_policy: BuildPolicy | None,
) -> EnvRecord:
    policy = build_policy or RuleBasedPolicy()
    factory = factory or default_factory()
    digest, snapshot = snapshot_or_raise(spec, cache)
    pinned = parse_spec(spec)
    name, version = pinned if pinned else (Path(spec).resolve().name, "local")
    dist = _project_name(snapshot, name)
    info = policy.explore(snapshot)
    work = Path(tempfile.mkdtemp(dir=cache, prefix=".build-"))
    try:
        plan, venv, first, attempts = _attempt_builds(
            factory, policy, snapshot, info, dist, work, spec
        )
        env_id = _env_id(name, version, digest, plan.commands)
        env_dir = cache / "envs" / env_id
        if (env_dir / "env.json").exists():
            return EnvRecord.load(env_dir / "env.json")
        paths = policy.test_paths(info)
        second = _test(factory, snapshot, venv, paths, trace=False, inifile=info.pytest_config)
        try:  # a rollout must not be able to read the source a task will be made from
            check_readable(snapshot, {"/venv": str(venv)}, snapshot, factory=factory)
        except ExposureError as e:
            raise BuildError(spec, "exposure", str(e), attempts) from e
        record = _record(spec, name, version, digest, snapshot, env_dir, plan, paths, first, second)
        record.info, record.attempts = asdict(info), attempts
        if info.pytest_config:
            record.test_command += f" -c {info.pytest_config}"
        record.license = read_license(snapshot)
        env_dir.mkdir(parents=True, exist_ok=True)
        venv.rename(env_dir / "venv")
        (env_dir / "trace.json").write_text(json.dumps(first.trace))
        record.save(env_dir / "env.json")
        return record
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _record(
    spec: str,
    name: str,
    version: str,
    digest: str,
    snapshot: Path,
    env_dir: Path,
    plan: InstallPlan,
    paths: list[str],
    first: TestRun,
    second: TestRun,
) -> EnvRecord:
    ids = sorted(set(first.outcomes) | set(second.outcomes))
    passing = [i for i in ids if first.passed(i) and second.passed(i)]
    flaky = [i for i in ids if first.passed(i) != second.passed(i)]
    failing = [i for i in ids if not first.passed(i) and not second.passed(i)]
    return EnvRecord(
        env_id=env_dir.name,
        spec=spec,
        name=name,
        version=version,
        snapshot_digest=digest,
        snapshot=str(snapshot),
        venv=str(env_dir / "venv"),
        install_plan=plan.name,
        install_commands=list(plan.commands),
        test_paths=paths,
        test_command="python -P -m pytest -p no:cacheprovider " + " ".join(paths),
        passing=passing,
        failing=failing,
        flaky=flaky,
        canaries_ok=first.canaries_ok and second.canaries_ok,
        baseline_tampered=sorted(set(first.tampered) | set(second.tampered)),
    )
