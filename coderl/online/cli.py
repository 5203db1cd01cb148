"""``coderl online``: ``cycle`` (one claim -> train -> gate cycle), ``run`` (cycles on a
schedule, optionally driving the simulated population through an in-process server),
``import`` (JSONL batch import of outcome events) and ``report`` (the last cycle's report)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from rich.console import Console

from coderl.config import Config, load_online_config
from coderl.online.cli_serve import build_server
from coderl.online.cycle import open_run, print_report, run_cycle
from coderl.online.server import BackgroundServer
from coderl.online.simulate import SimulatedPopulation


def _cfg(args: argparse.Namespace) -> Config:
    return load_online_config(args.config, args.overrides)


def cmd_cycle(args: argparse.Namespace) -> int:
    print_report(run_cycle(_cfg(args)))
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    """Repeat the cycle ``online.cycles`` times, ``online.interval_s`` apart; report cycle times."""
    cfg = _cfg(args)
    console = Console()
    bg = sim = server = None
    if cfg.online.simulate.enabled:
        store, registry = open_run(cfg)
        champ = registry.champion()
        assert champ is not None
        server = build_server(cfg, store, registry, champ)
        bg = BackgroundServer(server.app(), cfg.online.serve.host, cfg.online.serve.port)
        sim = SimulatedPopulation(bg.base_url, cfg.online.simulate, sandbox=cfg.online.sandbox)
        console.print(f"serving version {champ} at {bg.base_url} to the simulated population")
    times = []
    try:
        for i in range(cfg.online.cycles):
            start = time.time()
            if sim is not None:
                stats = sim.run(cfg.online.simulate.interactions_per_cycle)
                console.print(f"simulated traffic so far: {stats}")
                time.sleep(max(cfg.online.reward.windows_s.values()))  # let the join windows close
            rep = run_cycle(cfg, log=console.print)
            times.append(rep["cycle_s"])
            console.rule(f"cycle {i + 1}/{cfg.online.cycles}")
            print_report(rep, console)
            if server is not None:  # every promoted pointer, shared or a population's
                for pop in server.reload_routes():
                    console.print(f"now serving {server.router.route(pop).adapter} to {pop}")
            if i + 1 < cfg.online.cycles:
                time.sleep(max(0.0, cfg.online.interval_s - (time.time() - start)))
    finally:
        if bg is not None:
            bg.stop()
        if server is not None:
            server.policy.close()  # the serving engine (a vLLM server coderl started stops)
    console.print(
        f"cycle time: mean {sum(times) / len(times):.1f} s, max {max(times):.1f} s "
        f"over {len(times)} cycles"
    )
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    store, _ = open_run(_cfg(args))
    res = store.import_jsonl(args.file, batch_size=args.batch_size)
    print(
        json.dumps(
            {"stored": res.stored, "duplicates": res.duplicates, "rejected": dict(res.rejected)}
        )
    )
    for reason in res.reasons[:20]:
        print(f"rejected: {reason}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    path = Path(_cfg(args).run_dir) / "cycles.jsonl"
    if not path.exists():
        print(f"no cycles yet ({path} does not exist)")
        return 1
    lines = path.read_text().splitlines()
    print_report(json.loads(lines[-1]))
    return 0


SUBCOMMANDS = {"cycle": cmd_cycle, "run": cmd_run, "import": cmd_import, "report": cmd_report}


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("online", help="real-time RL from production interactions")
    ops = p.add_subparsers(dest="online_command", metavar="OP", required=True)
    for name, fn in SUBCOMMANDS.items():
        q = ops.add_parser(name, help=(fn.__doc__ or name).strip().splitlines()[0])
        q.add_argument("config", help="YAML preset, e.g. configs/online-demo.yaml")
        if name == "import":
            q.add_argument("file", help="JSONL file of outcome events")
            q.add_argument("--batch-size", type=int, default=500)
        q.add_argument("overrides", nargs="*", help="key=value overrides")
        q.set_defaults(func=fn)
