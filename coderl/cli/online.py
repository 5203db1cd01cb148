"""``coderl online``: ``cycle`` (one claim -> train -> gate cycle), ``run`` (cycles on a
schedule, optionally driving the simulated population through an in-process server),
``import`` (JSONL batch import of outcome events) and ``report`` (the last cycle's report).

``cycle``, ``run`` and ``import`` hold the run directory for their online role
(:func:`coderl.rundir.online_lock`): they run beside ``coderl serve``, never beside a writer
(``coderl train``, ``sft``, ...) or a second process of the same role. One that fails before its
first result (a port in use, a refused setting, a model that does not load) leaves a new run
directory as it found it: the store and registry it opened hold nothing yet and are removed
(:func:`coderl.online.runfiles.setup_only`). None of them runs in a training run's directory
(:func:`coderl.online.runfiles.refuse_training_run`)."""

from __future__ import annotations

import argparse
import json
import shlex
import socket
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path

from rich.console import Console

from coderl.agent.episode import EpisodeConfig
from coderl.cli.serve import build_server, listening_socket
from coderl.config import Config, load_online_config
from coderl.endpoint.calls import harness_format
from coderl.endpoint.http import BackgroundServer
from coderl.online.cycle import PHASES, open_run, run_cycle
from coderl.online.cycle_report import phase_totals, print_report, trained
from coderl.online.runfiles import refuse_training_run, setup_only
from coderl.online.simulate import SimulatedPopulation
from coderl.rundir import online_lock


def _cfg(args: argparse.Namespace) -> Config:
    """The online config of the command line; a training run's directory as ``run_dir`` is
    refused before anything is created there (:func:`refuse_training_run`)."""
    cfg = load_online_config(args.config, args.overrides)
    if args.online_command != "report":
        refuse_training_run(cfg.run_dir, f"coderl online {args.online_command}", args.config)
        from coderl.policy.threads import use_threads

        use_threads(cfg.threads)
    return cfg


def cmd_cycle(args: argparse.Namespace) -> int:
    """One cycle: claim the joined interactions, train a candidate, gate it, promote or not."""
    cfg = _cfg(args)
    with online_lock(
        cfg.run_dir, "cycle", "coderl online cycle", setup_only
    ):  # beside serve, not train
        print_report(run_cycle(cfg))
    return 0


def agent_episode_config(cfg: Config) -> EpisodeConfig:
    """The harness settings of simulated agent episodes: ``tasks.options.episode`` updated by
    ``online.simulate.episode``, in the served call format (:func:`harness_format`)."""
    from coderl.envs.registry import check_toolset

    call_format, template_tools = harness_format(cfg)
    fields = {**cfg.tasks.options.get("episode", {}), **cfg.online.simulate.episode}
    where = (
        "online.simulate.episode"
        if "toolsets" in cfg.online.simulate.episode
        else "tasks.options.episode"
    )
    check_toolset(fields.get("toolsets"), "function", f"{where}.toolsets")  # HumanEval traffic
    return EpisodeConfig(**fields | {"call_format": call_format, "template_tools": template_tools})


def cmd_run(args: argparse.Namespace) -> int:
    """Repeat the cycle ``online.cycles`` times, ``online.interval_s`` apart; report cycle times."""
    cfg = _cfg(args)
    simulate = cfg.online.simulate.enabled
    roles = ["cycle", "serve"] if simulate else ["cycle"]
    with ExitStack() as held:  # this process cycles (and serves): a writer or another is refused
        # the port and the locks before the model loads: a refusal comes in a second
        serve, keys = cfg.online.serve, ("online.serve.port=", "online.serve.host=")
        sock = listening_socket(serve.host, serve.port, keys) if simulate else None
        if sock is not None:
            held.callback(sock.close)
        for role in roles:
            held.enter_context(online_lock(cfg.run_dir, role, "coderl online run", setup_only))
        return _run_cycles(args, cfg, sock)


def _run_cycles(args: argparse.Namespace, cfg: Config, sock: socket.socket | None) -> int:
    console = Console()
    bg = sim = server = None
    if cfg.online.simulate.enabled:
        agent = cfg.online.simulate.agent
        episode = agent_episode_config(cfg) if agent else None  # refusals before the model loads
        store, registry = open_run(cfg)
        champ = registry.champion()
        assert champ is not None
        server = build_server(cfg, store, registry, champ)
        bg = BackgroundServer(server.app(), sock=sock)
        sim = SimulatedPopulation(
            bg.base_url,
            cfg.online.simulate,
            sandbox=cfg.online.sandbox,
            tokenizer=server.policy.tokenizer if agent else None,
            episode=episode,
            populations=list(cfg.online.populations),
        )
        kind = "agent episodes" if agent else "requests"
        console.print(f"serving version {champ} at {bg.base_url} to the simulated population "
                      f"({kind}, {cfg.engine.kind} engine)")  # fmt: skip
    reports = []
    try:
        for i in range(cfg.online.cycles):
            start = time.time()
            extra: dict[str, float] = {}
            if sim is not None:
                t = time.perf_counter()
                stats = sim.run(cfg.online.simulate.interactions_per_cycle)
                console.print(f"simulated traffic so far: {stats.line()}")
                wait = max(cfg.online.reward.windows_s.values())
                time.sleep(wait)  # let the join windows close
                extra["window_wait_s"] = wait
                extra["collect_s"] = time.perf_counter() - t
            rep = run_cycle(cfg, log=console.print, extra=extra)
            rep["total_s"] = rep["cycle_s"] + extra.get("collect_s", 0.0)  # what the phases sum to
            reports.append(rep)
            console.rule(f"cycle {i + 1}/{cfg.online.cycles}")
            print_report(rep, console)
            if server is not None:  # every promoted pointer, shared or a population's
                for pop in server.reload_routes():
                    console.print(f"now serving {server.router.route(pop).adapter} to {pop}")
            if i + 1 < cfg.online.cycles:
                time.sleep(max(0.0, cfg.online.interval_s - (time.time() - start)))
    except KeyboardInterrupt:  # the store and registry hold every finished cycle
        again = continue_command(args, cfg.online.cycles - len(reports))
        print(f"coderl online run: interrupted in cycle {len(reports) + 1} of "
              f"{cfg.online.cycles}; {len(reports)} finished cycles, the store and the registry "
              f"are kept in {cfg.run_dir}; continue with: {again}", file=sys.stderr)  # fmt: skip
        return 130
    finally:
        if bg is not None:
            bg.stop()
        if server is not None:
            server.policy.close()  # the serving engine (a vLLM server coderl started stops)
    console.print(cycle_time_summary(reports))
    return 0


def continue_command(args: argparse.Namespace, left: int) -> str:
    """The ``coderl online run`` line that goes on with the ``left`` cycles an interrupted run
    did not finish (its store and registry are reopened; the same line without
    ``online.cycles`` would run every cycle again)."""
    kept = [o for o in args.overrides if o.partition("=")[0].strip() != "online.cycles"]
    return shlex.join(["coderl", "online", "run", args.config, *kept, f"online.cycles={left}"])


def cycle_time_summary(reports: list[dict]) -> str:
    """Median cycle time (collect included) and the median of each phase summed over the
    cycle's tracks (:func:`coderl.online.cycle_report.phase_totals`), in seconds; over every cycle,
    and over the cycles in which some track trained a candidate (a cycle whose tracks all
    waited for ``min_batch`` only collected)."""

    def line(reps: list[dict]) -> str:
        totals = [phase_totals(r) for r in reps]
        med = {p: statistics.median(t.get(p, 0.0) for t in totals) for p in PHASES}
        split = " / ".join(f"{p} {v:.1f}" for p, v in med.items())
        return f"median {statistics.median(r['total_s'] for r in reps):.1f} s ({split})"

    out = f"cycle time: {line(reports)} over {len(reports)} cycles"
    done = [r for r in reports if trained(r)]
    if 0 < len(done) < len(reports):
        out += f"; {line(done)} over the {len(done)} that trained a candidate"
    return out


def cmd_import(args: argparse.Namespace) -> int:
    """Store outcome events from a JSONL file (rejected lines are counted, with line numbers)."""
    cfg = _cfg(args)
    with online_lock(cfg.run_dir, "import", "coderl online import", setup_only):
        store, _ = open_run(cfg)
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
    """Print the last cycle's report (run_dir/cycles.jsonl); CONFIG may be the run directory."""
    given = Path(args.config)
    if not given.exists():
        raise FileNotFoundError(
            f"{given} does not exist; give the online run's directory (its run_dir, e.g. "
            "runs/online-demo) or the preset it ran with (e.g. configs/online-demo.yaml)"
        )
    run_dir = given if given.is_dir() and not args.overrides else Path(_cfg(args).run_dir)
    path = run_dir / "cycles.jsonl"
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
        what = "YAML preset, e.g. configs/online-demo.yaml"
        q.add_argument(
            "config", help=what + (" (or the run directory)" if name == "report" else "")
        )
        if name == "import":
            q.add_argument("file", help="JSONL file of outcome events")
            q.add_argument("--batch-size", type=int, default=500, help="events per transaction")
        q.add_argument("overrides", nargs="*", help="key=value overrides")
        q.set_defaults(func=fn)
