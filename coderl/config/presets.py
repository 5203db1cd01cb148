"""Where the shipped presets are, and the line that refuses a config file that does not exist."""

from __future__ import annotations

from pathlib import Path

PRESETS = Path(__file__).resolve().parents[2] / "configs"
"""The shipped presets: the checkout's ``configs/``. A preset is given by its path, relative to
the working directory or absolute; outside the checkout that is this directory's path."""


def missing_config(path: Path) -> str:
    """The line that refuses a config ``path`` that does not exist: the shipped preset it
    names, if one (``configs/repair.yaml`` or ``repair`` from outside the checkout), as the path
    to give instead; else where the shipped presets are."""
    said = f"config file {str(path)!r} does not exist"
    if not path.is_absolute():
        for shipped in (PRESETS.parent / path, PRESETS / path.name, PRESETS / f"{path}.yaml"):
            if shipped.is_file():
                return f"{said}; the shipped preset is {shipped}: give that path"
    if PRESETS.is_dir():
        return f"{said}; presets are YAML files named by path, the shipped ones in {PRESETS}"
    return (
        f"{said}; presets are YAML files named by path (the shipped ones: the checkout's configs/)"
    )
