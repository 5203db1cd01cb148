"""The sharded trainer launched on Ray: one actor per rank, each running ``coderl train``.

``coderl train CONFIG trainer.distributed.enabled=true trainer.distributed.launcher=ray
trainer.distributed.world_size=2`` (in a process without ``WORLD_SIZE``, i.e. not a rank) starts
or joins Ray the way ``train-async`` does (:func:`coderl.ray_cluster.ensure_ray` with
``async.ray_address`` and ``async.ray_num_cpus``), then:

1. starts ``world_size`` actors of ``trainer.distributed.ray_cpus_per_rank`` CPUs each and
   asks each for its node; actors the cluster cannot place within :data:`START_TIMEOUT_S` are
   an error, not a wait;
2. rank 0's actor picks a free port on its node: the rendezvous (``MASTER_ADDR``,
   ``MASTER_PORT``);
3. every actor sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` (its place among the ranks on its
   node), ``MASTER_ADDR`` and ``MASTER_PORT``, moves to the driver's working directory and
   calls ``coderl train`` with the driver's own arguments (``coderl.cli.main``), which
   ``torchrun -m coderl train`` runs too: :func:`coderl.train.distributed.init_distributed`
   reads the same environment, and the training code is the same path.

Failure: the driver waits on every rank; the first rank that raises, dies, or returns a
non-zero status (a one-line user error it printed itself) ends the run: every actor is killed
(the others would wait in a collective for the failed one until gloo's own 30-minute timeout)
and :class:`RankFailed` names the rank. Once a rank has finished cleanly the rest get
:data:`FINISH_GRACE_S`. A Ray this driver started is shut down at the end, whatever happened.

Limits: CPU (gloo) ranks only. The actors reserve no GPU and are started with
``CUDA_VISIBLE_DEVICES=""``; a CUDA trainer is refused (per-actor GPU assignment and
``LOCAL_RANK`` under Ray's GPU isolation are not wired: launch CUDA ranks with ``torchrun``).
On several nodes the working directory, the config and ``run_dir`` must be at the same path on
every node (a shared filesystem: each rank writes its own DCP shard). The free port is released
by rank 0's actor before torch binds it, so another process could take it in between (the same
race as ``torchrun --standalone``). Not fault-tolerant: a failed rank ends the run; resume from
the last checkpoint (``coderl train --resume RUN_DIR`` relaunches on Ray).
"""

from __future__ import annotations

import argparse
import functools
import os
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

from coderl.config import Config, ConfigError

START_TIMEOUT_S = 120.0
"""Longest the driver waits for every rank's actor to be placed and report its node."""
FINISH_GRACE_S = 300.0
"""Longest the other ranks may run on after one rank has finished cleanly."""


class RankFailed(RuntimeError):
    """A rank raised, died, returned a non-zero status, or never started."""


def wants_ray_launch(cfg: Config) -> bool:
    """True in the driver of a Ray-launched sharded run (not in one of its ranks: a rank has
    ``WORLD_SIZE`` in its environment)."""
    d = cfg.trainer.distributed
    return d.enabled and d.launcher == "ray" and "WORLD_SIZE" not in os.environ


def train_argv(args: argparse.Namespace) -> list[str]:
    """The ``coderl train`` arguments of ``args`` (what the driver was given) for the ranks."""
    argv = [args.config] if args.config is not None else []
    argv += list(args.overrides)
    argv += ["--resume", args.resume] if args.resume else []
    return argv + ([] if args.report else ["--no-report"])


def launch(cfg: Config, argv: list[str], main: Callable[[list[str]], int | None]) -> int:
    """Run ``coderl train ARGV`` on ``trainer.distributed.world_size`` Ray actors (see the
    module docstring); 0 when every rank finished cleanly, else 1 after a one-line error.
    ``main``: the ``coderl`` entry each rank calls with ``["train", *argv]``
    (:func:`coderl.cli.main`; passed in from the command line's floor, never imported here).

    Raises:
        ConfigError: Ray is not installed, ``async.ray_address`` is unreachable, or the trainer
            device is CUDA.
    """
    d = cfg.trainer.distributed
    if cfg.trainer.device.startswith("cuda"):
        raise ConfigError(
            f"trainer.distributed.launcher=ray starts CPU (gloo) ranks only, not "
            f"trainer.device={cfg.trainer.device}; launch CUDA ranks with torchrun"
        )
    from coderl.ray_cluster import ensure_ray, shutdown_owned_ray

    address = cfg.async_.ray_address
    try:
        owns = ensure_ray(address, cfg.async_.ray_num_cpus)
    except ImportError:
        raise ConfigError(
            "trainer.distributed.launcher=ray needs Ray: pip install 'coderl[ray]'"
        ) from None
    except ConnectionError as err:
        line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"async.ray_address={address!r}: {line}") from None
    entry = functools.partial(main, ["train", *argv])
    try:
        run_ranks(d.world_size or 1, entry, cpus_per_rank=d.ray_cpus_per_rank, cwd=os.getcwd())
    except RankFailed as err:
        print(f"coderl train: error: {err}", file=sys.stderr)
        return 1
    finally:
        if owns:
            shutdown_owned_ray()
    return 0


class _RankActor:
    """One rank's process: says where it runs, then runs the entry with the rank's
    environment."""

    def node(self) -> tuple[str, str]:
        """``(node id, node IP)``."""
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def free_port(self) -> int:
        """A TCP port free on this node now (bound to port 0, then released)."""
        with socket.socket() as s:
            s.bind(("", 0))
            return int(s.getsockname()[1])

    def run(self, env: dict[str, str], cwd: str | None, entry: Callable[[], int | None]) -> int:
        os.environ.update(env)
        if cwd is not None:
            os.chdir(cwd)
        return int(entry() or 0)


def rank_envs(nodes: list[tuple[str, str]], port: int) -> list[dict[str, str]]:
    """The environment of each rank: ``nodes[r]`` is rank r's ``(node id, node IP)``; rank 0's
    node is the rendezvous; ``LOCAL_RANK`` counts the ranks before r on the same node."""
    envs = []
    for rank, (node, _) in enumerate(nodes):
        local = sum(1 for other, _ in nodes[:rank] if other == node)
        envs.append(
            {
                "RANK": str(rank),
                "WORLD_SIZE": str(len(nodes)),
                "LOCAL_RANK": str(local),
                "LOCAL_WORLD_SIZE": str(sum(1 for other, _ in nodes if other == node)),
                "MASTER_ADDR": nodes[0][1],
                "MASTER_PORT": str(port),
                "CUDA_VISIBLE_DEVICES": "",  # CPU ranks (see the module docstring)
            }
        )
    return envs


def run_ranks(
    world_size: int,
    entry: Callable[[], int | None],
    *,
    cpus_per_rank: float = 1.0,
    cwd: str | None = None,
    start_timeout_s: float = START_TIMEOUT_S,
    finish_grace_s: float = FINISH_GRACE_S,
) -> None:
    """Run ``entry()`` in ``world_size`` Ray actors, each with its rank's environment
    (:func:`rank_envs`) in ``cwd`` (None: the actor's own); Ray must be running. Every actor is
    killed on return, normal or not.

    Raises:
        RankFailed: an actor was not placed within ``start_timeout_s``; a rank raised, died or
            returned non-zero; or ranks were still running ``finish_grace_s`` after one finished.
    """
    import ray

    actor = ray.remote(_RankActor).options(num_cpus=cpus_per_rank)
    actors = [actor.remote() for _ in range(world_size)]
    try:
        try:
            nodes = ray.get([a.node.remote() for a in actors], timeout=start_timeout_s)
            port = ray.get(actors[0].free_port.remote(), timeout=start_timeout_s)
        except ray.exceptions.GetTimeoutError:
            cpus = ray.cluster_resources().get("CPU", 0)
            raise RankFailed(
                f"{world_size} rank actors of {cpus_per_rank:g} CPUs each were not all placed "
                f"within {start_timeout_s:g} s (the Ray cluster has {cpus:g} CPUs)"
            ) from None
        envs = rank_envs(nodes, port)
        refs = {actors[r].run.remote(env, cwd, entry): r for r, env in enumerate(envs)}
        _wait_all(refs, world_size, finish_grace_s)
    finally:
        for a in actors:
            ray.kill(a)


def _wait_all(refs: dict[Any, int], world_size: int, finish_grace_s: float) -> None:
    """Wait for every rank's ``run`` (``refs``: object ref -> rank); raise at the first
    failure."""
    import ray

    pending, deadline, first = dict(refs), None, None
    while pending:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        done, _ = ray.wait(list(pending), num_returns=1, timeout=timeout)
        if not done:
            late = sorted(pending.values())
            raise RankFailed(
                f"ranks {late} of {world_size} were still running {finish_grace_s:g} s after "
                f"rank {first} finished; stopped them"
            )
        rank = pending.pop(done[0])
        try:
            status = ray.get(done[0])
        except ray.exceptions.RayError as err:
            raise RankFailed(f"rank {rank} of {world_size} failed: {_one_line(err)}") from err
        if status != 0:
            raise RankFailed(
                f"rank {rank} of {world_size} exited with status {status} (its error is above)"
            )
        if deadline is None:
            deadline, first = time.monotonic() + finish_grace_s, rank


def _one_line(err: Exception) -> str:
    """The rank's own exception for a task error (``Type: message``), else Ray's first line."""
    import ray

    if isinstance(err, ray.exceptions.RayTaskError) and err.cause is not None:
        cause = err.cause
        lines = str(cause).strip().splitlines()
        return f"{type(cause).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__
