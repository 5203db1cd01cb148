"""A throwaway local PostgreSQL cluster (initdb + pg_ctl on a temporary directory).

Used by the tests and by ``coderl online`` demos that want PostgreSQL without a server set up.
It listens on 127.0.0.1 only, with ``trust`` authentication: never use it for real data. When run
as root the cluster is created and started as the ``postgres`` system user (PostgreSQL refuses
to run as root). ``fsync=off``: a machine crash may corrupt it (a process crash does not).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path


class PostgresUnavailable(RuntimeError):
    """PostgreSQL binaries are missing or the cluster did not start (the message says why)."""


def _bin(name: str) -> str:
    found = shutil.which(name)
    if found:
        return found
    for d in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True):
        if (d / name).exists():
            return str(d / name)
    raise PostgresUnavailable(
        f"{name} not found (install the Debian package 'postgresql': make sysdeps)"
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class LocalPostgres:
    """A running cluster; :meth:`stop` shuts it down and deletes its files."""

    root: Path
    port: int
    prefix: list[str]

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://coderl@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        """Create a database and return its SQLAlchemy URL."""
        import psycopg

        with psycopg.connect(
            f"host=127.0.0.1 port={self.port} user=coderl dbname=postgres", autocommit=True
        ) as c:
            c.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def stop(self) -> None:
        subprocess.run(
            [
                *self.prefix,
                _bin("pg_ctl"),
                "-D",
                str(self.root / "data"),
                "-m",
                "immediate",
                "stop",
            ],
            capture_output=True,
            check=False,
        )
        shutil.rmtree(self.root, ignore_errors=True)


def start(root: str | Path) -> LocalPostgres:
    """initdb + start a cluster under ``root`` on a free loopback port.

    Raises:
        PostgresUnavailable: binaries missing, or initdb / start failed (with their output).
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    initdb, pg_ctl = _bin("initdb"), _bin("pg_ctl")
    prefix: list[str] = []
    if os.geteuid() == 0:
        runuser = shutil.which("runuser")
        if runuser is None:
            raise PostgresUnavailable("running as root and runuser is missing")
        prefix = [runuser, "-u", "postgres", "--"]
        os.chmod(root, 0o777)
        shutil.chown(root, user="postgres")
    data = root / "data"
    port = _free_port()
    steps = [
        [initdb, "-D", str(data), "-A", "trust", "-U", "coderl", "--no-sync", "-E", "UTF8"],
        [
            pg_ctl,
            "-D",
            str(data),
            "-l",
            str(root / "log"),
            "-w",
            "-t",
            "30",
            "-o",
            f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off",
            "start",
        ],
    ]
    for cmd in steps:
        r = subprocess.run([*prefix, *cmd], capture_output=True, text=True, check=False)
        if r.returncode != 0:
            log = (root / "log").read_text() if (root / "log").exists() else ""
            raise PostgresUnavailable(
                f"{Path(cmd[0]).name} failed ({r.returncode}): {r.stderr.strip()} {log[-2000:]}"
            )
    return LocalPostgres(root, port, prefix)
