"""``coderl serve CONFIG``: the OpenAI-compatible endpoint on the registry's champion, recording
into the configured database; ``POST /v1/admin/reload`` picks up a newly promoted champion.

It samples through the rollout engine of ``cfg.engine`` (:func:`coderl.policy.rollout.build_engine`,
``training=False``): ``torch`` in process, or ``vllm`` (a server coderl starts, or ``engine.url``);
either way each interaction records the engine's sampled ids, their behaviour logprobs and the
registry version. A reload syncs the new champion into the same engine (a LoRA adapter for vLLM,
canary-checked) instead of starting another server.

A training run's directory (``coderl train``'s checkpoints) is refused in one line that says how
to serve its weights (:func:`coderl.online.runfiles.refuse_training_run`): serving there would
serve the base model and write a store and registry among the run's files.

The server holds the run directory for the ``serve`` role (:func:`coderl.rundir.online_lock`):
``coderl online cycle`` may run beside it (it claims what the server recorded), while a writer
(``coderl train``, ``sft``, ...) or a second ``coderl serve`` on the same directory is refused in
one line naming this server's pid.

Populations (``online.populations``): every population with an own champion in the registry is
served its own adapter, the rest the shared champion (:mod:`coderl.online.routing`); a reload
refreshes every route whose pointer moved. On ``torch`` each route is its own in-process policy;
on ``vllm`` each is a LoRA adapter of the one server (:func:`route_loader`).
"""

from __future__ import annotations

import argparse
import errno
import socket
from collections.abc import Callable
from typing import Any

from coderl.config import Config, ConfigError, load_online_config
from coderl.config.online import SHARED
from coderl.endpoint.calls import harness_format
from coderl.online.cycle import database_url, load_version, open_run
from coderl.online.registry import Registry
from coderl.online.routing import Route, Router, refresh
from coderl.online.runfiles import refuse_training_run, setup_only
from coderl.online.server import InteractionServer
from coderl.online.store import Store
from coderl.policy.base import Completion, SamplingParams
from coderl.policy.rollout import RolloutEngine, TorchRollout, build_engine
from coderl.rundir import online_lock


class AdapterSampler:
    """A population's adapter on a shared vLLM engine, as a route's sampler."""

    def __init__(self, engine: Any, name: str, tokenizer: Any) -> None:
        self.engine, self.name, self.tokenizer = engine, name, tokenizer

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        return list(self.engine.generate(prompts, params, adapter=self.name))


def route_loader(
    cfg: Config, registry: Registry, engine: RolloutEngine
) -> Callable[[str, int], Any]:
    """``load(population, version)`` -> the sampler of that route: the shared route retargets
    ``engine``; a population's route is its own :class:`TorchRollout` (torch) or its adapter
    loaded into ``engine``'s vLLM server (:meth:`~coderl.policy.vllm_engine.VLLMEngine.
    load_adapter`)."""

    def load(population: str, version: int) -> Any:
        policy = load_version(cfg, registry, version)
        if population == SHARED:
            engine.retarget(policy)
            return engine
        if isinstance(engine, TorchRollout):
            return TorchRollout(policy)
        vllm = engine.engine  # type: ignore[attr-defined]
        return AdapterSampler(
            vllm, vllm.load_adapter(policy, population, version), policy.tokenizer
        )

    return load


def build_server(
    cfg: Config,
    store: Store,
    registry: Registry,
    version: int,
    *,
    reload: Callable[[int], tuple[Any, int] | None] | None = None,
    engine: RolloutEngine | None = None,
) -> InteractionServer:
    """The server of ``online.serve`` on a registry version, in the run's call format, sampling
    through ``engine`` (None: one built from ``cfg.engine`` on that version's weights); every
    population with an own champion gets its route (:func:`route_loader`), and
    ``/v1/admin/reload`` refreshes the routes unless ``reload`` is given."""
    call_format, template_tools = harness_format(cfg)
    if engine is None:
        engine = build_engine(cfg, load_version(cfg, registry, version), training=False)
    router = Router(Route(engine, version))
    load = route_loader(cfg, registry, engine)
    for population, v in registry.own_champions().items():
        router.set(Route(load(population, v), v, population))
    return InteractionServer(
        engine,
        store,
        version=version,
        model_name=cfg.model.name,
        default_temperature=cfg.online.serve.temperature,
        max_new_tokens=cfg.online.serve.max_new_tokens,
        reload=reload,
        call_format=call_format,
        template_tools=template_tools,
        router=router,
        refresh=None if reload is not None else lambda r: refresh(r, registry, load),
        exploration=cfg.online.exploration,
    )


def run(args: argparse.Namespace) -> int:
    overrides = list(args.overrides)
    overrides += [f"online.serve.host={args.host}"] if args.host is not None else []
    overrides += [f"online.serve.port={args.port}"] if args.port is not None else []
    cfg = load_online_config(args.config, overrides)
    serve = cfg.online.serve
    refuse_training_run(cfg.run_dir, "coderl serve", args.config)  # its weights are not served
    sock = listening_socket(serve.host, serve.port)  # before the model loads: fail in a second
    try:  # a writer (train, sft) or a second server on this run dir is refused
        with online_lock(cfg.run_dir, "serve", "coderl serve", setup_only):
            return _serve(cfg, sock, args.access_log)
    finally:
        sock.close()


def _serve(cfg: Config, sock: socket.socket, access_log: bool) -> int:
    import uvicorn

    from coderl.policy.threads import use_threads

    use_threads(cfg.threads)
    store, registry = open_run(cfg)
    champ = registry.champion()
    assert champ is not None
    print(f"loading version {champ} ({cfg.model.name}) into the {cfg.engine.kind} engine ...")
    engine = build_engine(cfg, load_version(cfg, registry, champ), training=False)
    try:  # a reload refreshes every route whose pointer moved, in the same engine
        server = build_server(cfg, store, registry, champ, engine=engine)
        host, port = sock.getsockname()[:2]
        print(
            f"serving version {champ} on http://{host}:{port}/v1 in the "
            f"{server.call_format!r} call format through the {cfg.engine.kind} engine "
            f"(database {database_url(cfg)})"
        )
        # no per-request INFO line unless asked: a log holds what the server says, not traffic
        config = uvicorn.Config(server.app(), log_level="info", access_log=access_log)
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        engine.close()  # a vLLM server coderl started stops with it
    return 0


LISTEN_BACKLOG = 2048
"""uvicorn's default backlog: the server listens with it again when it starts."""


def listening_socket(
    host: str, port: int, flags: tuple[str, str] = ("--port", "--host")
) -> socket.socket:
    """A socket bound to ``host:port`` (port 0: a free one) and listening, checked before
    anything loads: listening holds the port, so a second server started while this one still
    loads its model is refused at once (a socket only bound would let it bind too, load, and
    fail at the end). Connections made before the server is up wait in the backlog.

    ``flags``: how the command line sets the port and the host (``coderl online run``:
    ``online.serve.port=`` and ``online.serve.host=``).

    Raises:
        ConfigError: the address cannot be bound (in use, or not this host's), naming the
            flags that change it.
    """
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(LISTEN_BACKLOG)
    except OSError as err:
        sock.close()
        port_flag, host_flag = flags
        if err.errno == errno.EADDRINUSE:
            sep = "" if port_flag.endswith("=") else " "
            hint = f"choose another with {port_flag}{sep}N, or {port_flag}{sep}0 for a free one"
        else:  # an unknown name, or an address this machine does not have
            hint = f"check {host_flag}: an address of this machine, e.g. 127.0.0.1 or 0.0.0.0"
        raise ConfigError(
            f"online.serve.host/port: cannot listen on {host}:{port}: {err.strerror} ({hint})"
        ) from err
    return sock


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("serve", help="OpenAI-compatible endpoint that records interactions")
    p.add_argument("config", help="YAML preset, e.g. configs/online-demo.yaml")
    p.add_argument("overrides", nargs="*", help="key=value overrides")
    p.add_argument("--host", default=None, help="address to listen on (default: online.serve.host)")
    p.add_argument(
        "--port", type=int, default=None, help="port (default: online.serve.port; 0: a free one)"
    )
    p.add_argument(
        "--access-log",
        action="store_true",
        help="log one line per request (uvicorn's access log; off by default)",
    )
    p.set_defaults(func=run)
