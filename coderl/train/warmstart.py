"""A content-addressed cache of the SFT warm start (``sft.cache``): a run whose SFT inputs match
an earlier build reuses its weights instead of running SFT again.

An entry is ``CACHE/warmstart/<key>/`` (``CACHE``: :func:`coderl.tasks.snapshot.cache_dir`,
``data/cache`` by default) holding what SFT writes under ``RUN_DIR/sft/``
(``trainable.safetensors``, ``state.json``, the per-batch log ``metrics.jsonl``), its build
record ``warmstart.json`` (the key, the inputs it hashes, the date, the demonstrations and the
SFT seconds it took) and ``manifest.json`` (every file's size and SHA-256, written last:
:func:`coderl.train.checkpoint.write_manifest`). ``key`` is the first 16 hex digits of the
SHA-256 of :func:`warmstart_inputs`: the cache format, the sources of the code on the SFT path
(:data:`SFT_CODE`), the torch and transformers versions, the ``model`` section and the SHA-256
of every model file (weights, tokenizer and chat template:
:func:`coderl.policy.loading.model_files`), the demonstrations (each training task's content
and its oracle's gold file), ``seed``, the ``sft`` section (``cache`` aside), the parts of
``tasks``, ``rollout`` and ``trainer`` SFT reads (the RL-only fields listed in
:data:`NOT_SFT_INPUTS` aside), ``sandbox``, the resolved device and precision, the CPU's model
name and torch's thread count (one and two threads give other weights).

A reused entry is copied into ``RUN_DIR/sft/`` and the copy is checked against the manifest, so
a damaged entry (or one replaced while it was copied) is found and SFT runs again and replaces
it; ``RUN_DIR/sft/warmstart.json`` then says ``"reused": true``. An entry is written in a
temporary directory under the cache and renamed into place: a build killed at any point leaves
no entry (only a ``.tmp-*`` folder, removed by a later store once an hour old; a killed
``coderl warm-start`` leaves a ``.build-*`` folder, removed once a day old), and of two
builders of one key the second keeps the first's intact entry.

Limits: SFT gives identical weights for the same inputs on one machine at one thread count
(tests/test_warmstart.py; two processes checked by hand); the CPU's model name stands for its
arithmetic (a machine of the same model name with another microcode or library build is not
told apart). Sections SFT does not read today (``reward``,
``algorithm``, ``eval``, ``engine``) are not hashed; a code change that makes SFT read them
changes :data:`SFT_CODE`'s digest. The held-out evaluation after SFT is not cached: it is
measured again in every run. ``coderl online`` runs SFT without the cache.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
import transformers

from coderl.config import Config
from coderl.policy.loading import model_files
from coderl.policy.precision import cpu_info
from coderl.tasks.snapshot import cache_dir
from coderl.train.checkpoint import MANIFEST, checkpoint_damage, sha256_file, write_manifest
from coderl.train.run import SFT_WEIGHTS, resolve_device

WARMSTART_FORMAT = 1
"""Bump when an entry's layout or meaning changes: every older entry then misses."""
SFT_CODE = (
    "train/sft.py",
    "train/batch.py",
    "train/step.py",
    "train/optim.py",
    "train/checkpoint.py",
    "train/run.py",
    "train/warmstart.py",
    "policy",
    "agent",
    "envs",
    "algorithms",
    "trajectory.py",
)
"""Sources (under the ``coderl`` package; a folder: every ``.py`` under it) whose text is part of
the key: the SFT loop, the forward and optimizer, LoRA and the tokenizer's use, and the harness
that renders oracle episodes."""
NOT_SFT_INPUTS = {
    "tasks": {"sampler", "pool", "tasks_per_step", "synth", "curriculum", "heldout_split"},
    "rollout": {"group_size", "temperature", "top_p", "concurrency", "branch"},
    "trainer": {
        "steps",
        "lr",
        "schedule",
        "warmup_steps",
        "update_epochs",
        "checkpoint_every",
        "keep_checkpoints",
        "distributed",
    },
    "sft": {"cache"},
}
"""Fields of the hashed sections that SFT does not read (RL's sampling, schedule and
checkpoints; SFT sets its own lr and constant schedule); every other field is hashed."""
INFO = "warmstart.json"
STALE_TMP_S = 3600.0
"""Age (s) after which a store's temporary folder is taken for a killed store's and removed."""
STALE_BUILD_S = 86400.0
"""Age (s) after which a ``coderl warm-start`` build folder (``.build-*``) is taken for a killed
build's and removed."""


@dataclass
class WarmStart:
    """What :func:`warm_start` did: ``path`` (the run's SFT weights file), ``key`` (None with
    ``sft.cache`` off), ``reused`` (taken from the cache, SFT not run)."""

    path: Path
    key: str | None
    reused: bool


def code_digest() -> str:
    """SHA-256 over the paths and texts of the :data:`SFT_CODE` sources."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for name in SFT_CODE:
        p = root / name
        for f in sorted(p.rglob("*.py")) if p.is_dir() else [p]:
            h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def demonstrations_digest(tasks: list[Any]) -> str:
    """SHA-256 over each task's content (its JSON) and, for a function task, the file its oracle
    writes (:func:`coderl.train.sft.oracle_message`: a HumanEval gold solution lives outside the
    task), in order."""
    from coderl.train.sft import oracle_message

    h = hashlib.sha256()
    for t in tasks:
        h.update(t.model_dump_json().encode() + b"\0")
        if t.kind == "function" and "entry_point" in t.extra:
            h.update(oracle_message(t).encode() + b"\0")
    return h.hexdigest()


def _section(cfg: Config, name: str) -> dict[str, Any]:
    dump: dict[str, Any] = getattr(cfg, name).model_dump(mode="json")
    return {k: v for k, v in dump.items() if k not in NOT_SFT_INPUTS.get(name, set())}


def warmstart_inputs(cfg: Config, tasks: list[Any]) -> dict[str, Any]:
    """Everything that determines the SFT weights of ``cfg`` on the demonstrations ``tasks``
    (JSON-serialisable; see the module docstring).

    Raises:
        FileNotFoundError: the model's files are missing (:func:`model_files`).
    """
    from coderl.train.sft import sft_bf16

    return {
        "format": WARMSTART_FORMAT,
        "code": code_digest(),
        "libraries": {"torch": torch.__version__, "transformers": transformers.__version__},
        "model_files": [sha256_file(p) for p in model_files(cfg.model.name)],
        "demonstrations": {"count": len(tasks), "sha256": demonstrations_digest(tasks)},
        "seed": cfg.seed,
        **{n: _section(cfg, n) for n in ("model", "sft", "tasks", "rollout", "trainer", "sandbox")},
        "device": resolve_device(cfg.trainer.device).type,
        "bf16": sft_bf16(cfg),
        # the CPU and the thread count change float summation order: 1 and 2 threads give
        # other SFT weights on the development machine
        "cpu": cpu_info()[0],
        "threads": torch.get_num_threads(),
    }


def warmstart_key(inputs: dict[str, Any]) -> str:
    """The entry name of ``inputs``: 16 hex digits of the SHA-256 of their sorted JSON."""
    text = json.dumps(inputs, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cache_root() -> Path:
    """``CACHE/warmstart`` (created)."""
    root = cache_dir() / "warmstart"
    root.mkdir(parents=True, exist_ok=True)
    return root


def entry_damage(entry: Path, key: str) -> str | None:
    """What is wrong with the cache entry (or a copy of it) ``entry`` for ``key``: no manifest,
    a file that differs from it (:func:`coderl.train.checkpoint.checkpoint_damage`), another
    key in its record; None when it is intact."""
    if not (entry / MANIFEST).is_file():
        return f"{MANIFEST} is missing"
    if damage := checkpoint_damage(entry):
        return damage
    try:
        info = json.loads((entry / INFO).read_text())
    except (OSError, ValueError):
        return f"{INFO} is unreadable"
    return None if info.get("key") == key else f"{INFO} names key {info.get('key')!r}"


def store(sft_dir: Path, key: str, info: dict[str, Any]) -> Path:
    """Copy the SFT output ``sft_dir`` into the cache as entry ``key`` with the build record
    ``info``: written in ``.tmp-<key>-<uuid>`` and renamed into place. An intact entry already
    there (another builder's) is kept; a damaged one is replaced. Returns the entry.

    Raises:
        OSError: the copy or the rename failed (the temporary folder is removed).
    """
    root = cache_root()
    for old, age in [
        *((p, STALE_TMP_S) for p in root.glob(".tmp-*")),
        *((p, STALE_BUILD_S) for p in root.glob(".build-*")),
    ]:
        try:
            stale = time.time() - old.stat().st_mtime > age  # left by killed stores and builds
        except FileNotFoundError:  # another process removed it
            continue
        if stale:
            shutil.rmtree(old, ignore_errors=True)
    final = root / key
    tmp = root / f".tmp-{key}-{uuid.uuid4().hex[:8]}"
    try:
        shutil.copytree(sft_dir, tmp, ignore=shutil.ignore_patterns(MANIFEST, INFO))
        (tmp / INFO).write_text(json.dumps({**info, "key": key}, indent=1) + "\n")
        write_manifest(tmp)  # last: it hashes what is on disk
        if final.exists() and entry_damage(final, key) is not None:
            trash = root / f".tmp-{key}-damaged-{uuid.uuid4().hex[:8]}"
            try:
                final.rename(trash)
            except FileNotFoundError:  # another builder moved it first
                pass
            shutil.rmtree(trash, ignore_errors=True)
        try:
            tmp.rename(final)
        except OSError:  # another builder's entry is in place (the rename would replace it)
            if not final.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def reuse(key: str, run_dir: Path) -> dict[str, Any] | None:
    """Copy entry ``key`` into ``run_dir/sft`` and check the copy; its build record, or None
    (no entry, or a damaged one: then ``run_dir/sft`` is removed and the reason printed)."""
    entry = cache_root() / key
    if not entry.is_dir():
        return None
    dest = Path(run_dir) / Path(SFT_WEIGHTS).parent
    shutil.rmtree(dest, ignore_errors=True)
    try:
        shutil.copytree(entry, dest)
        damage = entry_damage(dest, key)
    except FileNotFoundError:  # replaced by another builder while it was copied
        damage = "it changed while it was copied"
    if damage is not None:
        shutil.rmtree(dest, ignore_errors=True)
        print(f"warm start: cached entry {entry} is damaged ({damage}); building it again")
        return None
    info: dict[str, Any] = json.loads((dest / INFO).read_text())
    return info


def _mark(sft_dir: Path, info: dict[str, Any], reused: bool) -> None:
    """Write the run's ``sft/warmstart.json`` (the build record and ``reused``) and its manifest."""
    (sft_dir / INFO).write_text(json.dumps({**info, "reused": reused}, indent=1) + "\n")
    write_manifest(sft_dir)


def _demonstrations(cfg: Config) -> list[Any]:
    """The training tasks SFT demonstrates (:func:`coderl.train.sft.demonstration_tasks`).

    Raises:
        ConfigError: their source has no oracle (:func:`coderl.train.sft.demonstration_sources`).
    """
    from coderl.envs import build_environment
    from coderl.train.sft import demonstration_sources, demonstration_tasks

    env = build_environment(cfg)
    tasks = demonstration_tasks(cfg, env)
    demonstration_sources(cfg, env, tasks)  # a source without an oracle: one line, at once
    return tasks


def warm_start(cfg: Config) -> WarmStart:
    """The run's SFT warm start: with ``sft.cache``, the cached entry of its inputs copied into
    ``RUN_DIR/sft`` when there is an intact one, else :func:`coderl.train.sft.run_sft` and the
    result stored; without, :func:`run_sft` alone. Prints one line saying which.

    Raises:
        as :func:`coderl.train.sft.run_sft`.
    """
    from coderl.train.sft import run_sft

    tasks = _demonstrations(cfg)  # its refusals before the line that announces the work
    if not cfg.sft.cache:
        print("warm start: sft.cache=false: SFT runs and nothing is cached")
        return WarmStart(run_sft(cfg), None, False)
    inputs = warmstart_inputs(cfg, tasks)
    key = warmstart_key(inputs)
    entry = cache_root() / key
    sft_dir = Path(cfg.run_dir) / Path(SFT_WEIGHTS).parent
    if (info := reuse(key, Path(cfg.run_dir))) is not None:
        print(
            f"warm start: reused cached SFT adapter {key} (built {info['built']} from "
            f"{info['demonstrations']} demonstrations; delete {entry} or set sft.cache=false "
            "to rebuild); SFT did not run in this process"
        )
        _mark(sft_dir, info, reused=True)
        return WarmStart(Path(cfg.run_dir) / SFT_WEIGHTS, key, True)
    print(
        f"warm start: building SFT adapter {key} from {len(tasks)} demonstrations; it is "
        f"cached in {entry} and reused by later runs with the same inputs"
    )
    t0, c0 = time.perf_counter(), time.process_time()
    path = run_sft(cfg)
    info = {
        "built": datetime.now(UTC).isoformat(timespec="seconds"),
        "demonstrations": len(tasks),
        "sft_s": round(time.perf_counter() - t0, 3),
        "sft_cpu_s": round(time.process_time() - c0, 3),
        "inputs": inputs,
    }
    store(sft_dir, key, info)
    _mark(sft_dir, {**info, "key": key}, reused=False)
    return WarmStart(path, key, False)


def build_entry(cfg: Config, *, force: bool = False) -> WarmStart:
    """The cache entry of ``cfg``'s warm start, built when missing or damaged (``force``: the
    entry is removed first and built again), outside any run: SFT writes into a ``.build-*``
    folder under the cache, removed afterwards (``path`` of the result no longer exists).

    Raises:
        as :func:`coderl.train.sft.run_sft`.
    """
    import tempfile

    root = cache_root()
    if force:
        key = warmstart_key(warmstart_inputs(cfg, _demonstrations(cfg)))
        trash = root / f".tmp-{key}-forced-{uuid.uuid4().hex[:8]}"
        if (root / key).is_dir():
            (root / key).rename(trash)  # gone at once for readers; then deleted
            shutil.rmtree(trash, ignore_errors=True)
    sft = cfg.sft.model_copy(update={"cache": True})
    with tempfile.TemporaryDirectory(dir=root, prefix=".build-") as tmp:
        return warm_start(cfg.model_copy(update={"run_dir": tmp, "sft": sft}))
