"""``coderl serve CONFIG``: the OpenAI-compatible endpoint on the registry's champion, recording
into the configured database; ``POST /v1/admin/reload`` picks up a newly promoted champion."""

from __future__ import annotations

import argparse
from typing import Any

from coderl.online.config import load_online_config
from coderl.online.cycle import load_version, open_run
from coderl.online.server import InteractionServer


def run(args: argparse.Namespace) -> int:
    import uvicorn

    cfg = load_online_config(args.config, args.overrides)
    store, registry = open_run(cfg)
    champ = registry.champion()
    assert champ is not None

    def reload(current: int) -> tuple[Any, int] | None:
        v = registry.champion()
        return None if v is None or v == current else (load_version(cfg, registry, v), v)

    server = InteractionServer(
        load_version(cfg, registry, champ),
        store,
        version=champ,
        model_name=cfg.model.name,
        default_temperature=cfg.serve.temperature,
        max_new_tokens=cfg.serve.max_new_tokens,
        reload=reload,
    )
    print(
        f"serving version {champ} on http://{cfg.serve.host}:{cfg.serve.port}/v1 "
        f"(database {cfg.database_url})"
    )
    uvicorn.run(server.app(), host=cfg.serve.host, port=cfg.serve.port, log_level="info")
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("serve", help="OpenAI-compatible endpoint that records interactions")
    p.add_argument("config", help="YAML preset, e.g. configs/online-demo.yaml")
    p.add_argument("overrides", nargs="*", help="key=value overrides")
    p.set_defaults(func=run)
