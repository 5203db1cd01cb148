"""Weight-version stores: the trainer publishes ``(version, weights)``, rollout workers fetch the
latest between episodes (or between turns).

- :class:`MemoryWeightStore`: one process, any number of threads; publish keeps a detached copy.
- :class:`FileWeightStore`: a directory of ``v00000012.safetensors`` files plus a ``LATEST``
  pointer, written atomically (write, then ``os.replace``); works across processes and, on a
  shared file system, across machines. Keeps the newest ``keep`` versions.

The Ray backend has its own store (an actor holding object references), with the same methods.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Protocol

from safetensors.torch import load_file, save_file

from coderl.asyncrl.types import Weights


class WeightStore(Protocol):
    def publish(self, version: int, weights: Weights) -> None: ...
    def latest_version(self) -> int:
        """The newest published version, -1 before the first publish."""
        ...

    def get(self) -> tuple[int, Weights]:
        """The newest ``(version, weights)``. Raises LookupError before the first publish."""
        ...


def _check_version(new: int, old: int) -> None:
    if new <= old:
        raise ValueError(f"weight versions must increase: publishing {new} after {old}")


class MemoryWeightStore:
    """In-process store shared by threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._version = -1
        self._weights: Weights = {}

    def publish(self, version: int, weights: Weights) -> None:
        """Store a detached copy of ``weights`` as ``version``.

        Raises:
            ValueError: ``version`` is not newer than the latest.
        """
        copy = {k: v.detach().clone() for k, v in weights.items()}
        with self._lock:
            _check_version(version, self._version)
            self._version, self._weights = version, copy

    def latest_version(self) -> int:
        with self._lock:
            return self._version

    def get(self) -> tuple[int, Weights]:
        with self._lock:
            if self._version < 0:
                raise LookupError("no weights have been published yet")
            return self._version, self._weights


class FileWeightStore:
    """Store in a directory; pickles as its path, so worker processes can open it."""

    def __init__(self, directory: str | os.PathLike[str], *, keep: int = 3) -> None:
        if keep < 2:
            raise ValueError(
                f"keep must be >= 2 (a reader may be loading the previous one), got {keep}"
            )
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.keep = keep

    def _path(self, version: int) -> Path:
        return self.directory / f"v{version:08d}.safetensors"

    def publish(self, version: int, weights: Weights) -> None:
        """Write ``weights`` as ``version``, then point ``LATEST`` at it; prune old versions.

        Raises:
            ValueError: ``version`` is not newer than the latest.
        """
        _check_version(version, self.latest_version())
        tmp = self.directory / f".tmp-{version}.safetensors"
        save_file({k: v.detach().contiguous().cpu() for k, v in weights.items()}, tmp)
        os.replace(tmp, self._path(version))
        pointer = self.directory / ".LATEST.tmp"
        pointer.write_text(str(version))
        os.replace(pointer, self.directory / "LATEST")
        for old in sorted(self.directory.glob("v*.safetensors"))[: -self.keep]:
            old.unlink(missing_ok=True)

    def latest_version(self) -> int:
        try:
            return int((self.directory / "LATEST").read_text())
        except FileNotFoundError:
            return -1

    def get(self) -> tuple[int, Weights]:
        for _ in range(5):  # the file may be pruned between reading LATEST and opening it
            version = self.latest_version()
            if version < 0:
                raise LookupError(f"no weights have been published in {self.directory}")
            try:
                return version, load_file(self._path(version))
            except FileNotFoundError:
                continue
        raise LookupError(f"weights in {self.directory} kept changing while being read")
