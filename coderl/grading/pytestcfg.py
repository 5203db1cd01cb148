"""The pytest configuration file of a test run: always one the grader names with ``-c``, never
one pytest discovers in the workspace.

Without ``-c`` pytest reads the first configuration file it finds walking up from the test
paths (``pytest.toml`` and ``.pytest.toml`` first under pytest 9), so a file the agent adds
beside the tests (``pkg/pytest.ini`` with ``pythonpath`` or ``addopts``) would shape the graded
run. :func:`run_config` names the file pytest would read in the pristine tree (the environment's
recorded one, else the one pytest's own walk finds there); every name it can return is protected
at any depth (``coderl.grading.protected``), so the graded tree holds the base's copy. With
none, the run reads :data:`EMPTY_CONFIG`, a file the runner writes outside the workspace.
"""

from __future__ import annotations

import configparser
import tomllib
from pathlib import Path

CONFIG_NAMES: tuple[str, ...] = (
    "pytest.toml",
    ".pytest.toml",
    "pytest.ini",
    ".pytest.ini",
    "pyproject.toml",
    "tox.ini",
    "setup.cfg",
)
"""The names pytest discovers, in its order of precedence within one directory (pytest 9's
``_pytest.config.findpaths.CONFIG_LOADERS_BY_NAME``; older versions read a subset)."""
EMPTY_CONFIG = "/coderl/input/pytest.ini"
"""Sandbox path of the empty configuration a run without one reads (``[pytest]`` and nothing
else; written by ``coderl.grading.runner.run_pytest`` into its read-only input directory)."""


def run_config(root: Path, recorded: str | None, test_paths: list[str]) -> str | None:
    """The ``root``-relative configuration file a run of ``test_paths`` reads, or ``None`` (the
    run reads :data:`EMPTY_CONFIG`).

    ``recorded``: the environment's ``pytest_config`` (``coderl.envbuild.detect``), returned as
    is. Otherwise the walk pytest makes without ``-c``: from the test paths' common directory up
    to ``root``, the first file of :data:`CONFIG_NAMES` that holds a pytest section. ``root``
    must be a pristine tree (a snapshot or a task's base), never an agent's.
    """
    if recorded:
        return recorded
    parts = [Path(p).parts for p in test_paths] or [()]
    common: list[str] = []
    for level in zip(*parts, strict=False):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    here = Path(*common) if common else Path()
    if not (root / here).is_dir():
        here = here.parent
    for rel in (here, *here.parents):
        for name in CONFIG_NAMES:
            if _holds_pytest_config(root / rel / name):
                return (rel / name).as_posix()
    return None


def _holds_pytest_config(path: Path) -> bool:
    """Whether pytest would take ``path`` as its configuration file (it has pytest's section;
    ``pytest.*`` files always count). A file that does not parse counts as none."""
    if not path.is_file():
        return False
    if path.name.startswith(("pytest.", ".pytest.")):
        return True
    try:
        if path.name == "pyproject.toml":
            tool = tomllib.loads(path.read_text(encoding="utf-8")).get("tool")
            return isinstance(tool, dict) and isinstance(tool.get("pytest"), dict)
        ini = configparser.ConfigParser(interpolation=None, strict=False)
        ini.read_string(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, configparser.Error):
        return False
    return ini.has_section("tool:pytest" if path.name == "setup.cfg" else "pytest")
