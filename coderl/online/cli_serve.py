"""``coderl serve CONFIG``: the OpenAI-compatible endpoint on the registry's champion, recording
into the configured database; ``POST /v1/admin/reload`` picks up a newly promoted champion.

It samples through the rollout engine of ``cfg.engine`` (:func:`coderl.policy.rollout.build_engine`,
``training=False``): ``torch`` in process, or ``vllm`` (a server coderl starts, or ``engine.url``);
either way each interaction records the engine's sampled ids, their behaviour logprobs and the
registry version. A reload syncs the new champion into the same engine (a LoRA adapter for vLLM,
canary-checked) instead of starting another server.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from coderl.config import Config, load_online_config
from coderl.online.calls import harness_format
from coderl.online.cycle import database_url, load_version, open_run
from coderl.online.registry import Registry
from coderl.online.server import InteractionServer
from coderl.online.store import Store
from coderl.policy.rollout import RolloutEngine, build_engine


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
    through ``engine`` (None: one built from ``cfg.engine`` on that version's weights)."""
    call_format, template_tools = harness_format(cfg)
    if engine is None:
        engine = build_engine(cfg, load_version(cfg, registry, version), training=False)
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
    )


def run(args: argparse.Namespace) -> int:
    import uvicorn

    cfg = load_online_config(args.config, args.overrides)
    store, registry = open_run(cfg)
    champ = registry.champion()
    assert champ is not None

    engine = build_engine(cfg, load_version(cfg, registry, champ), training=False)

    def reload(current: int) -> tuple[Any, int] | None:
        v = registry.champion()
        if v is None or v == current:
            return None
        engine.retarget(load_version(cfg, registry, v))  # the same engine, new weights
        return engine, v

    try:
        server = build_server(cfg, store, registry, champ, reload=reload, engine=engine)
        serve = cfg.online.serve
        print(
            f"serving version {champ} on http://{serve.host}:{serve.port}/v1 in the "
            f"{server.call_format!r} call format through the {cfg.engine.kind} engine "
            f"(database {database_url(cfg)})"
        )
        uvicorn.run(server.app(), host=serve.host, port=serve.port, log_level="info")
    finally:
        engine.close()  # a vLLM server coderl started stops with it
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("serve", help="OpenAI-compatible endpoint that records interactions")
    p.add_argument("config", help="YAML preset, e.g. configs/online-demo.yaml")
    p.add_argument("overrides", nargs="*", help="key=value overrides")
    p.set_defaults(func=run)
