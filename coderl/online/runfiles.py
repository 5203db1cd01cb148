"""What an online run directory holds, for the commands that are not the online loop: which of
its entries hold no result yet (a refused ``coderl online run`` removes them again), the config
its registry's versions were made with, and the registry version ``coderl export`` and ``coderl
eval`` take (by default the shared champion).

Layout (``RUN_DIR``)::

    registry/               coderl.online.registry: versions/<n>/, CHAMPION, history.jsonl
    registry/config.yaml    the config of the first online command on it (model, LoRA shape,
                            tasks, harness): what a version's weights are loaded into
    online.db (-wal, -shm)  the SQLite store (coderl.online.store), unless online.database is set
    cycles.jsonl            one report per cycle

No torch here: the command line resolves a source in a second, before any model loads.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from pathlib import Path

from coderl.config import load_tree
from coderl.config.online import SHARED
from coderl.online.registry import POINTER, POPULATIONS, Registry
from coderl.rundir import SFT_WEIGHTS, existing_logs, list_checkpoints

SAVE_DONE = "coderl_policy.txt"
"""The file :meth:`coderl.policy.LocalPolicy.save` writes last: a version directory holding it
holds complete weights."""
REGISTRY = "registry"
RUN_CONFIG = "config.yaml"
"""Under ``RUN_DIR/registry/``: the config the registry's versions were made with."""
STORE_FILES = ("online.db", "online.db-wal", "online.db-shm", "online.db-journal")
RESULT_TABLES = (
    "interactions",
    "feedback_events",
    "rejected_events",
    "rewards",
    "training_batches",
)
"""Store tables whose rows are results (traffic, outcomes, claimed batches); the others
(policy versions, counters, baselines) only mirror or derive from them."""


def _registry_setup_only(root: Path) -> bool:
    """Whether registry ``root`` holds only what opening it makes: the pointer, the history,
    the config and version 0's ``meta.json`` (the base model; a warm start's weights are a
    result)."""
    allowed = {POINTER, "history.jsonl", RUN_CONFIG, "versions/0/meta.json"}
    files = {str(p.relative_to(root)) for p in root.rglob("*") if not p.is_dir()}
    return files <= allowed and not any((root / POPULATIONS).glob("*"))


def store_holds_records(path: Path) -> bool:
    """Whether the SQLite store ``path`` holds a row in any of :data:`RESULT_TABLES` (read-only;
    an unreadable database counts as holding some: it is never removed as empty)."""
    if not path.is_file():
        return False
    try:
        con = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    except sqlite3.Error:
        return True
    try:
        names = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        return any(
            con.execute(f"SELECT 1 FROM {t} LIMIT 1").fetchone() is not None  # names: constants
            for t in RESULT_TABLES
            if t in names
        )
    except sqlite3.Error:
        return True
    finally:
        con.close()


def setup_only(run_dir: Path, created: set[str]) -> bool:
    """Whether every entry in ``created`` (names a command created in ``run_dir``) is online
    setup that holds no result: the registry as opening it leaves it, the SQLite store (with its
    journal files, only when the database itself is new) without a recorded row, an empty
    ``cycles.jsonl``. What :func:`coderl.rundir.online_lock` may remove when the command fails
    before its first result."""
    for name in created:
        path = run_dir / name
        if name == REGISTRY:
            ok = path.is_dir() and _registry_setup_only(path)
        elif name in STORE_FILES:
            ok = "online.db" in created and not store_holds_records(run_dir / "online.db")
        elif name == "cycles.jsonl":
            ok = path.is_file() and path.stat().st_size == 0
        else:
            ok = False
        if not ok:
            return False
    return True


def refuse_training_run(run_dir: str | Path, command: str, preset: str) -> None:
    """Refuse to run the online ``command`` (``coderl serve``, ``coderl online run``, ...) in the
    directory of a training run (``coderl train``: a ``config.yaml`` beside checkpoints, SFT
    weights or logs), before anything is created there: it would serve and train the base model
    of ``preset``, not the run's weights, and write its store and registry among the run's files.

    Raises:
        FileExistsError: one line naming the run and the commands that serve its weights
            (``coderl export RUN --out DIR``, then ``command PRESET model.name=DIR
            run_dir=NEW``; ``--merged`` and ``DIR/merged`` for a LoRA run).
    """
    root = Path(run_dir)
    saved = root / "config.yaml"
    if not saved.is_file():
        return
    ckpts = list_checkpoints(root)
    if ckpts:
        what = f"checkpoints up to {ckpts[-1].name}"
    elif (root / SFT_WEIGHTS).is_file():
        what = f"SFT weights ({SFT_WEIGHTS})"
    elif logs := existing_logs(root):
        what = f"logs ({', '.join(p.name for p in logs)})"
    else:
        return
    try:
        lora = bool((load_tree(saved).get("model") or {}).get("lora"))
    except (OSError, ValueError):  # an unreadable config.yaml: the plain export's advice
        lora = False
    flag, model = (" --merged", "DIR/merged") if lora else ("", "DIR")
    raise FileExistsError(
        f"run_dir={run_dir} is a training run (coderl train; {what}), not an online run: "
        f"{command} would use the base model and write its store and registry into it; to "
        f"serve the run's weights: coderl export {run_dir}{flag} --out DIR, then {command} "
        f"{preset} model.name={model} run_dir=NEW"
    )


@dataclass(frozen=True)
class OnlineRun:
    """An online run directory as ``coderl export`` / ``eval`` read it."""

    run_dir: Path
    registry: Registry
    config: Path
    """``registry/config.yaml``."""
    version: int | None
    """The registry version a version directory named (None: none named)."""


def online_source(path: str | Path) -> bool:
    """Whether ``path`` names an online run: its directory (a ``registry/`` and no training
    checkpoint), its ``registry/``, or one version directory ``registry/versions/N``."""
    p = Path(path)
    if (p / REGISTRY / "versions").is_dir() and not (p / "checkpoints").is_dir():
        return True
    if p.name == REGISTRY and (p / "versions").is_dir():
        return True
    return p.parent.name == "versions" and p.parent.parent.name == REGISTRY and p.name.isdigit()


def open_online_run(path: str | Path) -> OnlineRun:
    """The online run ``path`` names (see :func:`online_source`).

    Raises:
        FileNotFoundError: the registry has no ``config.yaml`` (a run made before online
            commands recorded it; the line says where to put the preset it ran with).
    """
    p = Path(path)
    version = None
    if p.parent.name == "versions" and p.name.isdigit():
        version, p = int(p.name), p.parent.parent.parent
    elif p.name == REGISTRY:
        p = p.parent
    root = p / REGISTRY
    config = root / RUN_CONFIG
    if not config.is_file():
        raise FileNotFoundError(
            f"{p} is an online run whose registry records no config ({config} is missing: runs "
            f"made before it was recorded); copy the preset the run used to {config}"
        )
    return OnlineRun(p, Registry(root), config, version)


def pick_version(run: OnlineRun, version: int | None) -> tuple[int, Path]:
    """``(version, its directory)``: ``version``, else the one a version directory named, else
    the shared champion.

    Raises:
        FileNotFoundError: no candidate was promoted yet (the champion is still version 0, the
            base model) or there is no champion; the version has no weights of its own (the
            base model: ``--base`` evaluates it) or its save did not finish; an unknown version
            (lists the known ones).
    """
    reg, d = run.registry, run.run_dir
    chosen = version if version is not None else run.version
    if chosen is None:
        chosen = reg.champion()
        base_only = chosen is not None and reg.meta(chosen).get("base_only")
        if chosen is None or base_only:
            raise FileNotFoundError(
                f"{d}: no candidate has been promoted yet (the champion is "
                f"{'the base model, version 0' if base_only else 'not set'}); run more cycles "
                f"(coderl online run PRESET run_dir={d}), or give a registry version with "
                f"--version N (known: {reg.versions()})"
            )
    if chosen not in reg.versions():
        raise FileNotFoundError(
            f"{d}: registry version {chosen} does not exist (known: {reg.versions()})"
        )
    if reg.meta(chosen).get("base_only"):
        raise FileNotFoundError(
            f"{d}: registry version {chosen} is the base model itself (no weights of its own); "
            f"`coderl eval {d} --base` evaluates it"
        )
    if not (reg.version_dir(chosen) / SAVE_DONE).is_file():
        raise FileNotFoundError(
            f"{d}: registry version {chosen} holds no complete weights (its save did not "
            f"finish; known: {reg.versions()})"
        )
    return chosen, reg.version_dir(chosen)


def version_status(run: OnlineRun, version: int) -> str:
    """``promoted``/``candidate``/``rejected`` and, for the shared champion, ``champion``."""
    meta = run.registry.meta(version)
    said = str(meta.get("status", "candidate"))
    if run.registry.champion() == version:
        said = "champion"
    pop = meta.get("population")
    return said + (f", population {pop}" if pop not in (None, SHARED) else "")


def describe(run: OnlineRun, version: int) -> str:
    """One line naming the version a command reads (stderr of export and eval)."""
    return f"{run.run_dir}: registry version {version} ({version_status(run, version)})"
