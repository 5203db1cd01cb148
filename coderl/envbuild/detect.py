"""Build-system and test-setup detection, and install-command proposals, for a Python repository.

Rule-based: reads ``pyproject.toml``, ``setup.cfg``, ``setup.py``, requirement files, ``tox.ini``
and the pytest configuration, finds the test directories and the importable top-level names, and
scans test files for third-party imports. :func:`propose_install_plans` turns that into an ordered
list of install plans (most specific first) for the environment builder to try.

Nothing here runs repository code: ``setup.py`` is read as text, never executed.
"""

from __future__ import annotations

import ast
import configparser
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

TEST_EXTRAS = ("test", "tests", "testing", "dev")
# import name -> distribution name, for test dependencies whose names differ
IMPORT_TO_DIST = {
    "yaml": "pyyaml",
    "dateutil": "python-dateutil",
    "attr": "attrs",
    "PIL": "pillow",
    "bs4": "beautifulsoup4",
    "sklearn": "scikit-learn",
    "dns": "dnspython",
    "jwt": "pyjwt",
    "Crypto": "pycryptodome",
    "_pytest": "pytest",
}
_NOT_DISTS = {"setuptools", "pkg_resources", "conftest", "test", "tests", "testing"}


@dataclass
class ProjectInfo:
    """What :func:`detect` found in a repository root."""

    build_files: list[str] = field(default_factory=list)
    """Which of ``pyproject.toml``, ``setup.py``, ``setup.cfg`` exist."""
    build_backend: str | None = None
    """``[build-system].build-backend`` from pyproject.toml, if any."""
    source_root: str = "."
    """Directory holding the importable packages: ``src`` for a src layout, else ``.``."""
    top_level: list[str] = field(default_factory=list)
    """Importable top-level packages and modules under ``source_root`` (tests excluded)."""
    test_dirs: list[str] = field(default_factory=list)
    """Directories (or single files) holding tests, relative to the root."""
    test_extras: list[str] = field(default_factory=list)
    """Optional-dependency groups that look like test requirements."""
    requirement_files: list[str] = field(default_factory=list)
    """Requirement files, test ones first."""
    tox_deps: list[str] = field(default_factory=list)
    """``deps`` of tox's ``[testenv]`` (requirement strings and ``-r`` lines)."""
    test_imports: list[str] = field(default_factory=list)
    """Distributions that the test files import and that are neither stdlib nor the project."""
    pytest_config: str | None = None
    """Where pytest configuration lives (``pytest.ini``, ``pyproject.toml``, ...), if anywhere."""
    needs_pytest_cov: bool = False
    """The pytest configuration's addopts (pyproject, setup.cfg, pytest.ini or tox.ini) ask for
    ``--cov`` (wcwidth), or a ``conftest.py`` uses
    pytest-cov's ``no_cover`` marker (unregistered without pytest-cov: an error under
    ``filterwarnings = error``, as in python-dateutil)."""


def _read_toml(path: Path) -> dict[str, object]:
    if not path.exists():
        return {}
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError):
        return {}


def _read_ini(path: Path) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None, strict=False)
    try:
        parser.read_string(path.read_text(encoding="utf-8", errors="replace"))
    except configparser.Error:
        pass
    return parser


def _is_test_path(rel: str) -> bool:
    parts = Path(rel).parts
    name = parts[-1]
    in_test_dir = any(p in ("tests", "test", "testing") for p in parts[:-1])
    return (
        in_test_dir
        or name.startswith("test_")
        or name.endswith("_test.py")
        or name == "conftest.py"
    )


def _top_level(root: Path, source_root: str) -> list[str]:
    base = root / source_root
    names = []
    for p in sorted(base.iterdir()):
        if p.name in ("tests", "test", "testing", "docs", "doc", "examples", "setup.py", "build"):
            continue
        if p.is_dir() and (p / "__init__.py").exists():
            names.append(p.name)
        elif p.suffix == ".py" and not _is_test_path(p.name) and p.name not in ("conftest.py",):
            names.append(p.stem)
    return [n for n in names if n.isidentifier() and not n.startswith(("_", "."))]


def _test_dirs(root: Path, top_level: list[str], source_root: str) -> list[str]:
    found = [d for d in ("tests", "test", "testing") if (root / d).is_dir()]
    for pkg in top_level:
        for d in ("tests", "test"):
            rel = Path(source_root) / pkg / d
            if (root / rel).is_dir():
                found.append(rel.as_posix())
    if not found:  # single-file test modules at the root (e.g. six's test_six.py)
        found = sorted(p.name for p in root.glob("test_*.py"))
    return found


def _third_party_imports(root: Path, test_dirs: list[str], own: set[str]) -> list[str]:
    names: set[str] = set()
    files: list[Path] = []
    for d in test_dirs:
        p = root / d
        files += [p] if p.is_file() else sorted(p.rglob("*.py"))
    local = {p.stem for p in files} | {p.parent.name for p in files}
    for path in files:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except SyntaxError:
            continue
        # module-level imports only: imports inside try/except or functions are optional
        for node in tree.body:
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    stdlib = set(sys.stdlib_module_names)
    keep = names - stdlib - own - local - _NOT_DISTS
    return sorted(IMPORT_TO_DIST.get(n, n) for n in keep if n.isidentifier())


def _pyproject_facts(info: ProjectInfo, root: Path) -> None:
    data = _read_toml(root / "pyproject.toml")
    build = data.get("build-system")
    if isinstance(build, dict):
        info.build_backend = build.get("build-backend")
    project = data.get("project")
    extras = project.get("optional-dependencies", {}) if isinstance(project, dict) else {}
    info.test_extras += [e for e in TEST_EXTRAS if isinstance(extras, dict) and e in extras]
    tool = data.get("tool")
    if isinstance(tool, dict) and isinstance(tool.get("pytest"), dict):
        info.pytest_config = info.pytest_config or "pyproject.toml"
        opts = tool["pytest"].get("ini_options", {})
        info.needs_pytest_cov |= "--cov" in str(opts.get("addopts", ""))


def _ini_facts(info: ProjectInfo, root: Path) -> None:
    if (root / "setup.cfg").exists():
        cfg = _read_ini(root / "setup.cfg")
        if cfg.has_section("options.extras_require"):
            extras = cfg["options.extras_require"]
            info.test_extras += [e for e in TEST_EXTRAS if e in extras]
        if cfg.has_section("tool:pytest"):
            info.pytest_config = info.pytest_config or "setup.cfg"
            info.needs_pytest_cov |= "--cov" in cfg["tool:pytest"].get("addopts", "")
    if (root / "pytest.ini").exists():
        info.pytest_config = "pytest.ini"
        ini = _read_ini(root / "pytest.ini")
        if ini.has_section("pytest"):
            info.needs_pytest_cov |= "--cov" in ini["pytest"].get("addopts", "")
    if (root / "tox.ini").exists():
        tox = _read_ini(root / "tox.ini")
        if tox.has_section("testenv"):
            deps = tox["testenv"].get("deps", "")
            lines = [ln.strip() for ln in deps.splitlines()]
            info.tox_deps = [ln for ln in lines if ln and "{" not in ln and not ln.startswith("#")]
        if tox.has_section("pytest"):
            info.pytest_config = info.pytest_config or "tox.ini"
            info.needs_pytest_cov |= "--cov" in tox["pytest"].get("addopts", "")


def detect(root: Path) -> ProjectInfo:
    """Inspect a repository root (read-only) and return what it holds."""
    info = ProjectInfo()
    info.build_files = [
        f for f in ("pyproject.toml", "setup.py", "setup.cfg") if (root / f).exists()
    ]
    src = root / "src"
    info.source_root = "src" if src.is_dir() and _top_level(root, "src") else "."
    info.top_level = _top_level(root, info.source_root)
    info.test_dirs = _test_dirs(root, info.top_level, info.source_root)
    _pyproject_facts(info, root)
    _ini_facts(info, root)
    reqs = sorted(p.relative_to(root).as_posix() for p in root.glob("*requirements*.txt"))
    reqs += sorted(p.relative_to(root).as_posix() for p in root.glob("requirements/*.txt"))
    info.requirement_files = sorted(reqs, key=lambda r: ("test" not in r and "dev" not in r, r))
    info.test_extras = list(dict.fromkeys(info.test_extras))
    info.test_imports = _third_party_imports(root, info.test_dirs, set(info.top_level))
    info.needs_pytest_cov |= _uses_cov_marker(root)
    return info


def _uses_cov_marker(root: Path) -> bool:
    """A ``conftest.py`` (outside hidden directories) refers to ``mark.no_cover``."""
    for path in root.rglob("conftest.py"):
        rel = path.relative_to(root).parts
        if not any(part.startswith(".") for part in rel) and path.is_file():
            if "mark.no_cover" in path.read_text(encoding="utf-8", errors="replace"):
                return True
    return False


@dataclass(frozen=True)
class InstallPlan:
    """One candidate way to install a repository's test environment into ``/venv``."""

    name: str
    """Short label, e.g. ``project+extras``."""
    commands: tuple[str, ...]
    """Shell commands run in order in ``/testbed`` (they may reach the package registry)."""


PIP = "/venv/bin/python -m pip install --disable-pip-version-check -q"


def propose_install_plans(info: ProjectInfo, *, max_plans: int = 10) -> list[InstallPlan]:
    """Ordered install plans, most specific first (at most ``max_plans``).

    Every plan installs pytest; plans that install the project itself rely on ``PYTHONPATH``
    pointing at the workspace so that the workspace copy, not the installed one, is imported.
    """
    test_reqs = ["pytest"] + (["pytest-cov"] if info.needs_pytest_cov else [])
    test_reqs += [d for d in info.test_imports if d != "pytest"]
    base = " ".join(f"'{r}'" for r in test_reqs)
    has_build = bool(info.build_files)
    extras = ",".join(info.test_extras)
    reqfiles = " ".join(f"-r {r}" for r in info.requirement_files)
    tox = " ".join(f"'{d}'" if not d.startswith("-r") else d for d in info.tox_deps)
    plans: list[InstallPlan] = []
    if has_build and extras:
        plans.append(InstallPlan("project+extras", (f"{PIP} '.[{extras}]' {base}",)))
    if has_build:
        plans.append(InstallPlan("project+test-imports", (f"{PIP} . {base}",)))
    if has_build and reqfiles:
        plans.append(InstallPlan("project+requirements", (f"{PIP} . {base} {reqfiles}",)))
    if has_build and tox:
        plans.append(InstallPlan("project+tox-deps", (f"{PIP} . {base} {tox}",)))
    if reqfiles:
        plans.append(InstallPlan("requirements", (f"{PIP} {base} {reqfiles}",)))
    plans.append(InstallPlan("test-imports", (f"{PIP} {base}",)))
    if has_build:
        plans.append(InstallPlan("project+pytest", (f"{PIP} . pytest",)))
        no_iso = f"{PIP} --no-build-isolation setuptools wheel && {PIP} --no-build-isolation ."
        plans.append(InstallPlan("project-no-isolation", (no_iso, f"{PIP} {base}")))
    plans.append(InstallPlan("pytest-only", (f"{PIP} pytest",)))
    others = " ".join(f"'{r}'" for r in test_reqs if r != "pytest")
    plans.append(InstallPlan("old-pytest", (f"{PIP} 'pytest<8' {others}".strip(),)))
    unique: dict[tuple[str, ...], InstallPlan] = {}
    for plan in plans:
        unique.setdefault(plan.commands, plan)
    return list(unique.values())[:max_plans]
