"""Content-addressed, read-only repository snapshots, from a PyPI sdist or a local directory.

A snapshot is a directory under ``<cache>/snapshots/<digest>`` whose name is the SHA-256 of its
contents (relative paths, executable bits and file bytes), so the same sources always get the same
id and two tasks built from the same sources share one copy. Sandboxes mount it as the read-only
lower layer of a copy-on-write workspace, so no rollout can change it.

Not protected against: processes on the host (not in a sandbox) can write to a snapshot; modes
are normalised to 0644/0755 so that a sandbox owns a writable view. ``tree_digest`` re-checks one.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import stat
import tarfile
import tempfile
import zipfile
from pathlib import Path

# Things that are never part of a snapshot: VCS data, build output and caches.
_SKIP_DIRS = {".git", ".hg", ".svn", "__pycache__", ".tox", ".nox", ".pytest_cache", ".eggs"}
_SPEC = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>[A-Za-z0-9.+!_-]+)$")


CHECKOUT_DATA = Path(__file__).resolve().parents[2] / "data"
"""The checkout's ``data/`` (where the shipped tasks are read from, ``coderl.tasks.repos``)."""


def cache_dir() -> Path:
    """The cache root: ``$CODERL_CACHE`` (unless empty: an empty value once made the working
    directory the cache), else the checkout's ``data/cache`` (gitignored) when coderl runs from a
    checkout, else ``./data/cache``; symlinks resolved, created on demand.

    The checkout's, not the working directory's: the shipped tasks are read from the checkout
    whatever the directory, so a command run from elsewhere found the tasks and no built
    environment for them ("no built environment matches ...", with a hint to rebuild them all).
    Resolved because built environments record absolute paths: a checkout whose ``data/cache``
    links to a shared cache must record the shared cache's paths, or the records break when
    that checkout is removed (two shipped environments did)."""
    default = CHECKOUT_DATA / "cache" if CHECKOUT_DATA.is_dir() else Path("data/cache")
    root = Path(os.environ.get("CODERL_CACHE") or default).resolve()
    root.mkdir(parents=True, exist_ok=True)
    return root


def parse_spec(spec: str) -> tuple[str, str] | None:
    """``NAME==VERSION`` -> ``(name, version)``; ``None`` when ``spec`` is not of that form."""
    m = _SPEC.match(spec.strip())
    return (m["name"], m["version"]) if m else None


def download_sdist(name: str, version: str, dest: Path) -> Path:
    """Download the sdist of ``name==version`` with pip (no wheels, no deps) into ``dest``.

    pip prepares an sdist's metadata by running its build backend, which is repository code, so
    the download runs inside a sandbox with network access and ``dest`` mounted read-write.

    Raises:
        RuntimeError: pip failed (unknown name/version, no sdist published, no network); the
            message holds pip's last lines.
    """
    from coderl.sandbox import Limits, Sandbox

    dest.mkdir(parents=True, exist_ok=True)
    existing = _find_archive(dest, name, version)
    if existing is not None:
        return existing
    cmd = "python3 -m pip download --disable-pip-version-check --no-binary :all: --no-deps -q "
    cmd += f"-d /sdists '{name}=={version}'"
    # a fresh download directory per sdist: the build backend that pip runs cannot touch the
    # archives already cached
    with tempfile.TemporaryDirectory() as empty, tempfile.TemporaryDirectory(dir=dest) as out:
        limits = Limits(timeout_s=600.0, cpu_s=600)
        with Sandbox.create(empty, limits=limits, rw_mounts={"/sdists": out}, network=True) as sb:
            res = sb.exec(cmd)
        fetched = _find_archive(Path(out), name, version)
        if fetched is not None:
            fetched.rename(dest / fetched.name)
    archive = _find_archive(dest, name, version)
    if res.exit_code != 0 or archive is None:
        tail = "\n".join((res.stderr or res.stdout).strip().splitlines()[-5:])
        raise RuntimeError(f"could not download the sdist of {name}=={version}: {tail}")
    return archive


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _find_archive(dest: Path, name: str, version: str) -> Path | None:
    want = f"{_norm(name)}-{version}".lower()
    for path in sorted(dest.iterdir()):
        for ext in (".tar.gz", ".tgz", ".tar.bz2", ".zip"):
            if path.name.endswith(ext):
                stem = path.name[: -len(ext)]
                dist, _, ver = stem.rpartition("-")
                if f"{_norm(dist)}-{ver}".lower() == want:
                    return path
    return None


def unpack(archive: Path, dest: Path) -> Path:
    """Unpack an sdist into ``dest`` and return its single top-level directory (or ``dest``).

    Uses tarfile's ``data`` filter, which refuses absolute paths, ``..`` and device files.
    """
    dest.mkdir(parents=True, exist_ok=True)
    if archive.suffix == ".zip":
        with zipfile.ZipFile(archive) as zf:
            for member in zf.namelist():
                if member.startswith("/") or ".." in Path(member).parts:
                    raise ValueError(f"{archive}: unsafe path in archive: {member}")
            zf.extractall(dest)
    else:
        with tarfile.open(archive) as tf:
            tf.extractall(dest, filter="data")
    entries = [p for p in dest.iterdir()]
    return entries[0] if len(entries) == 1 and entries[0].is_dir() else dest


def _walk(root: Path) -> list[Path]:
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in sorted(filenames):
            path = Path(dirpath) / name
            if path.is_file() and not path.is_symlink() and not name.endswith((".pyc", ".pyo")):
                files.append(path)
    return files


def tree_digest(root: Path) -> str:
    """SHA-256 over (relative path, executable bit, file bytes) of every file, in sorted order."""
    h = hashlib.sha256()
    for path in _walk(root):
        rel = path.relative_to(root).as_posix()
        executable = os.access(path, os.X_OK)
        h.update(f"{rel}\0{int(executable)}\0".encode())
        h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()


def normalize_modes(root: Path) -> None:
    """Directories 0755, files 0644 (0755 when executable): sandboxes see the snapshot through a
    read-only lower layer and must own a writable copy-on-write view of it."""
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            (Path(dirpath) / name).chmod(0o755)
        for name in filenames:
            p = Path(dirpath) / name
            if not p.is_symlink():
                p.chmod(0o755 if os.access(p, os.X_OK) else 0o644)
    root.chmod(0o755)


def clear_setid(root: Path) -> int:
    """Clear setuid, setgid and sticky bits below ``root`` (symlinks untouched, no recursion
    limit); returns how many entries changed. Run on every tree a sandbox wrote to a host
    directory (a virtualenv built in a sandbox), so no set-id file reaches the host."""
    changed = 0
    stack = [str(root)]
    while stack:
        here = stack.pop()
        with os.scandir(here) as it:
            for entry in it:
                st = entry.stat(follow_symlinks=False)
                if stat.S_ISLNK(st.st_mode):
                    continue
                if st.st_mode & (stat.S_ISUID | stat.S_ISGID | stat.S_ISVTX):
                    os.chmod(entry.path, stat.S_IMODE(st.st_mode) & 0o777)
                    changed += 1
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
    return changed


def snapshot_dir(source: Path, *, cache: Path | None = None) -> tuple[str, Path]:
    """Copy ``source`` into a content-addressed read-only snapshot; returns ``(digest, path)``.

    Idempotent: an existing snapshot with the same digest is reused.
    """
    cache = cache or cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    digest = tree_digest(source)
    target = cache / "snapshots" / digest[:16]
    if target.exists():
        return digest, target
    staging = Path(tempfile.mkdtemp(dir=cache, prefix=".staging-"))
    for path in _walk(source):
        out = staging / path.relative_to(source)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, out)
    normalize_modes(staging)
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        staging.rename(target)
    except OSError:  # another process made the same snapshot first
        shutil.rmtree(staging, ignore_errors=True)
    return digest, target


def snapshot_spec(spec: str, *, cache: Path | None = None) -> tuple[str, Path]:
    """Snapshot ``NAME==VERSION`` (sdist from the package index) or a local directory path.

    Raises:
        FileNotFoundError: ``spec`` is neither ``NAME==VERSION`` nor an existing directory.
        RuntimeError: the sdist could not be downloaded.
    """
    cache = cache or cache_dir()
    pinned = parse_spec(spec)
    if pinned is None:
        path = Path(spec)
        if not path.is_dir():
            raise FileNotFoundError(f"{spec!r} is neither NAME==VERSION nor a directory")
        return snapshot_dir(path.resolve(), cache=cache)
    archive = download_sdist(*pinned, cache / "sdists")
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        return snapshot_dir(unpack(archive, Path(tmp)), cache=cache)
