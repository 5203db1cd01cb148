"""``tasks.synth``: new frontier tasks synthesised inside the loop when the pool runs dry.

A pool (:class:`coderl.train.sampling.PoolSampler`) learns each task's pass rate; RL can only
sharpen what the policy sometimes does, so the tasks that carry signal are the *active* ones (a
running pass rate strictly inside (0, 1)). When the policy outgrows its tasks, or never reaches
them, the active band empties. :class:`SynthSampler` wraps the run's sampler and, once per *tick*
(each call of :meth:`SynthSampler.metrics`: one per training step, and one before the first
step, where ``coderl train`` runs its pre-pass with or without samples; that one is not logged),
reads the pool's statistics per difficulty level (the proposer's ``level_of``:
``task.extra["fnrepair"]["level"]`` of :mod:`coderl.synth.fnrepair`, ``task.extra["ladder"]`` of
:mod:`coderl.tasks.ladder`) and decides (:func:`plan`, a pure function):

- **when**: fewer than ``min_active`` active tasks, or a level is *saturated* (pooled pass rate
  >= ``saturate`` over at least ``min_samples`` outcomes) while the next level up has no task
  (or fewer than ``per_request``) in the pool;
- **at which level**: for a saturated level, the next one up; otherwise the level whose pooled
  pass rate is nearest ``target`` (one level down when that one is at most ``floor``: too hard;
  one up when it is saturated); ``start_level`` while no level has ``min_samples`` outcomes.

A request (``per_request`` tasks at one level, drawn from the training seeds only, with a key
derived from (run seed, tick)) runs in a background process
(:func:`coderl.synth.fnrepair.synthesise`: propose, then validate each task in fresh sandboxes:
the gold patch resolves it, the unedited file does not). Its valid tasks are admitted to the pool
``lag`` ticks later, waiting for the request if it is late, so the admission tick, and so every
later draw, is the same in every run with the same seed. At most one request is in flight; the
pool never exceeds ``max_tasks``.

Metrics per tick: ``synth/requested`` (tasks asked for), ``synth/level`` (NaN: none),
``synth/proposed``, ``synth/validated``, ``synth/admitted`` (this tick's admission) and the same
per level (``synth/<what>_L<level>``), ``synth/wait_s`` (time the admission waited: the
critical-path cost), ``synth/request_s`` (the request's own wall time, off the critical path),
``synth/pool_tasks``, ``synth/admitted_total``; the pool's per-level statistics as
``pool/level<level>/{tasks,active,pass_rate}``.

State (in every checkpoint with the sampler's; restored before the pool's, so the pool's outcomes
of admitted tasks are kept): the tick, the counters, every admitted task (full JSON) and the
request in flight. On ``--resume`` a request in flight is started again: it is deterministic in
its request, so the resumed run admits the same tasks at the same tick.

Proposers (:data:`PROPOSERS`): ``fnrepair`` makes function-repair tasks (the seeds of
:mod:`coderl.tasks.fnseeds`; levels 0-4 of :mod:`coderl.synth.fnrepair`); ``repo`` makes new bugs
in a training repository (:func:`coderl.synth.repo.synthesise_ladder`) stated at a level of the
repository ladder (0-3, :mod:`coderl.tasks.ladder`). Each family reads its own levels
(``Proposer.level_of``). With a ``tasks.mix`` whose entries are the ladder's levels,
``tasks.synth.source: repo-L{level}`` sends each new task to its level's entry and the statistics
are pooled over those entries.

Limits: a repository request runs a test suite per mutant (seconds to minutes per request on 2
cores, off the critical path unless it is late); a request that raises (a sandbox failure) stops
the run at admission rather than admitting something different from an uninterrupted run.
"""

from __future__ import annotations

import math
import multiprocessing
import time
import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from coderl.config import SynthConfig
from coderl.progress import inner_note
from coderl.synth import fnrepair
from coderl.synth.repo import synthesise_ladder
from coderl.tasks import ladder
from coderl.tasks.spec import Task


@dataclass(frozen=True)
class Proposer:
    """How one family of tasks is synthesised and carried through JSON (requests cross a process
    boundary, admitted tasks live in checkpoints)."""

    run: Callable[[dict[str, Any]], dict[str, Any]]
    """Request -> ``{"proposed": n, "tasks": [task JSON], "seconds": s}`` (module docstring)."""
    load: Callable[[dict[str, Any]], Any]
    """Task JSON -> task."""
    dump: Callable[[Any], dict[str, Any]]
    """Task -> task JSON."""
    level_of: Callable[[Any], int | None] = fnrepair.level_of
    """A task's difficulty level in this family (None: not one of its tasks)."""
    max_level: int = fnrepair.MAX_LEVEL
    """The hardest level."""
    options: Callable[[SynthConfig], dict[str, Any]] = lambda cfg: {}
    """What a request carries beyond level, n, key and exclude (from ``tasks.synth``)."""


def _dump(task: Task) -> dict[str, Any]:
    return task.model_dump(mode="json")


PROPOSERS: dict[str, Proposer] = {
    "fnrepair": Proposer(
        fnrepair.synthesise, Task.model_validate, _dump, fnrepair.level_of, fnrepair.MAX_LEVEL
    ),
    "repo": Proposer(
        synthesise_ladder,
        Task.model_validate,
        _dump,
        ladder.level_of,
        ladder.MAX_LEVEL,
        lambda cfg: {"repos": list(cfg.repos), "max_tries": cfg.max_tries},
    ),
}
"""``tasks.synth.proposer`` -> :class:`Proposer`; the only dispatch point."""


class Pool(Protocol):
    """What synthesis reads and changes of a pool (:class:`coderl.train.sampling.PoolSampler`)."""

    tasks: list[Any]
    outcomes: dict[str, list[int]]

    def status(self, task_id: str) -> str: ...


def level_stats(
    pool: Pool | Sequence[Pool], level_of: Callable[[Any], int | None] = fnrepair.level_of
) -> dict[int, dict[str, float]]:
    """Per difficulty level (``level_of``; default: the repair family's) of the tasks of
    ``pool`` (or of several pools together): ``tasks``, ``active`` and ``samples`` (kept
    outcomes) counts and the pooled ``pass_rate`` (NaN without outcomes)."""
    stats: dict[int, dict[str, float]] = {}
    for one in [pool] if not isinstance(pool, Sequence) else pool:
        for t in one.tasks:
            level = level_of(t)
            if level is None:
                continue
            s = stats.setdefault(
                level, {"tasks": 0.0, "active": 0.0, "samples": 0.0, "solved": 0.0}
            )
            xs = one.outcomes[t.id]
            s["tasks"] += 1
            s["active"] += one.status(t.id) == "active"
            s["samples"] += len(xs)
            s["solved"] += sum(xs)
    for s in stats.values():
        solved = s.pop("solved")
        s["pass_rate"] = solved / s["samples"] if s["samples"] else math.nan
    return stats


def plan(
    stats: dict[int, dict[str, float]],
    active: int,
    cfg: SynthConfig,
    max_level: int = fnrepair.MAX_LEVEL,
) -> int | None:
    """The level (0..``max_level``) to synthesise at now, or None (module docstring: when, and
    at which level)."""
    known = {lv: s["pass_rate"] for lv, s in stats.items() if s["samples"] >= cfg.min_samples}
    saturated = [lv for lv, p in known.items() if p >= cfg.saturate and lv < max_level]
    starved = [lv for lv in saturated if stats.get(lv + 1, {}).get("tasks", 0.0) < cfg.per_request]
    if active >= cfg.min_active and not starved:
        return None
    if starved:
        return max(starved) + 1
    if not known:
        return min(cfg.start_level, max_level)
    level = min(known, key=lambda lv: (abs(known[lv] - cfg.target), lv))
    if known[level] >= cfg.saturate:
        return min(level + 1, max_level)
    if known[level] <= cfg.floor:
        return max(level - 1, 0)
    return level


class SynthSampler:
    """The run's sampler (``inner``: a pool, or a mix whose ``cfg.source`` entry is a pool) with
    synthesis (module docstring). Every :class:`coderl.train.sampling.TaskSource` method is the
    inner sampler's, except :meth:`metrics` (a tick) and the state."""

    def __init__(self, inner: Any, cfg: SynthConfig, seed: int) -> None:
        if cfg.proposer not in PROPOSERS:
            raise ValueError(
                f"tasks.synth.proposer: unknown {cfg.proposer!r}; valid: {sorted(PROPOSERS)}"
            )
        self.inner, self.cfg, self.seed = inner, cfg, seed
        self.proposer = PROPOSERS[cfg.proposer]
        self.tick = 0
        self.admitted: list[dict[str, Any]] = []
        """Every admitted task (JSON), in admission order: what a resumed run re-admits."""
        self.pending: dict[str, Any] | None = None
        """The request in flight: ``{"due": tick, "request": {...}}``."""
        self.totals: Counter[str] = Counter()
        self._future: Future[dict[str, Any]] | None = None
        self._executor: Executor | None = None

    # --- the TaskSource surface, delegated -------------------------------------------------
    @property
    def position(self) -> int:
        return int(self.inner.position)

    @position.setter
    def position(self, value: int) -> None:
        self.inner.position = value

    @property
    def step(self) -> int:
        return int(self.inner.step)

    @step.setter
    def step(self, value: int) -> None:
        self.inner.step = value

    def at(self, i: int) -> tuple[str, Any]:
        return self.inner.at(i)  # type: ignore[no-any-return]

    def take(self, n: int) -> list[tuple[int, Any]]:
        return self.inner.take(n)  # type: ignore[no-any-return]

    def observe(self, tasks: list[Any], infos: list[dict[str, Any]]) -> None:
        self.inner.observe(tasks, infos)

    def source_of(self, task: Any) -> str | None:
        return self.inner.source_of(task)  # type: ignore[no-any-return]

    def prepass_tasks(self) -> list[Any]:
        return self.inner.prepass_tasks()  # type: ignore[no-any-return]

    def forget_before(self, i: int) -> None:
        self.inner.forget_before(i)

    # --- synthesis ----------------------------------------------------------------------
    def _label(self, level: int) -> str | None:
        """The mix entry that receives tasks of ``level`` (None: no mix)."""
        return self.cfg.source.format(level=level) if self.cfg.source else None

    def pools(self) -> list[Pool]:
        """The pools that receive new tasks: the run's pool, the ``source`` entry's, or (a
        ``source`` with ``{level}``) each level's entry that the mix has."""
        if not self.cfg.source:
            return [self.inner]
        labels = dict.fromkeys(self._label(lv) for lv in range(self.proposer.max_level + 1))
        return [self.inner.subs[k] for k in labels if k in self.inner.subs]

    def pool(self) -> Pool:
        """The first of :meth:`pools` (the only one unless ``source`` names levels)."""
        return self.pools()[0]

    def _admit(self, tasks: list[Any], level: int) -> list[Any]:
        label = self._label(level)
        if label is not None:
            return self.inner.admit(tasks, label)  # type: ignore[no-any-return]
        return self.inner.admit(tasks)  # type: ignore[no-any-return]

    def _submit(self, request: dict[str, Any]) -> None:
        if self._executor is None:
            if self.cfg.executor == "process":
                ctx = multiprocessing.get_context("spawn")
                self._executor = ProcessPoolExecutor(1, mp_context=ctx)
            else:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="coderl-synth")
            weakref.finalize(self, self._executor.shutdown, wait=False, cancel_futures=True)
        self._future = self._executor.submit(self.proposer.run, request)

    def _admission(self, m: dict[str, float]) -> None:
        """Admit the request in flight if it is due (waiting for it if late)."""
        if self.pending is None or self.pending["due"] > self.tick:
            return
        if self._future is None:  # resumed with a request in flight: run it again
            self._submit(self.pending["request"])
        assert self._future is not None
        t0 = time.perf_counter()
        if not self._future.done():  # late: the step waits, minutes for a repository request
            request = self.pending["request"]
            inner_note(
                f"synth: waiting for the request in flight ({request['n']} level-"
                f"{request['level']} tasks, proposed and validated in sandboxes)"
            )
        result = self._future.result()
        m["synth/wait_s"] = time.perf_counter() - t0
        m["synth/request_s"] = float(result.get("seconds", math.nan))
        level = int(self.pending["request"]["level"])
        room = max(self.cfg.max_tasks - sum(len(p.tasks) for p in self.pools()), 0)
        valid = [self.proposer.load(t) for t in result["tasks"]]
        train = [t for t in valid if t.split == "train"]  # never admit held-out material
        added = self._admit(train[:room], level)
        self.admitted += [self.proposer.dump(t) for t in added]
        for what, n in (
            ("proposed", result["proposed"]),
            ("validated", len(valid)),
            ("admitted", len(added)),
        ):
            m[f"synth/{what}"] = float(n)
            m[f"synth/{what}_L{level}"] = float(n)
            self.totals[what] += n
        self.pending, self._future = None, None

    def synth_tick(self) -> dict[str, float]:
        """One tick: admit what is due, then maybe request more (module docstring)."""
        m = {"synth/requested": 0.0, "synth/level": math.nan, "synth/wait_s": 0.0}
        m.update({f"synth/{w}": 0.0 for w in ("proposed", "validated", "admitted")})
        self._admission(m)
        pools = self.pools()
        stats = level_stats(pools, self.proposer.level_of)
        active = sum(p.status(t.id) == "active" for p in pools for t in p.tasks)
        level = (
            plan(stats, active, self.cfg, self.proposer.max_level) if self.pending is None else None
        )
        size = sum(len(p.tasks) for p in pools)
        if level is not None and size < self.cfg.max_tasks:
            request = {
                "level": level,
                "n": self.cfg.per_request,
                "key": f"{self.seed}/{self.tick}/{level}",
                "exclude": sorted(t.id for p in pools for t in p.tasks),
                **self.proposer.options(self.cfg),
            }
            self.pending = {"due": self.tick + self.cfg.lag, "request": request}
            self._submit(request)
            m["synth/requested"], m["synth/level"] = float(self.cfg.per_request), float(level)
            self.totals["requested"] += self.cfg.per_request
        for lv, s in sorted(stats.items()):
            m.update({f"pool/level{lv}/{k}": v for k, v in s.items() if k != "samples"})
        m["synth/pool_tasks"] = float(sum(len(p.tasks) for p in pools))
        m["synth/admitted_total"] = float(self.totals["admitted"])
        self.tick += 1
        return m

    def metrics(self) -> dict[str, float]:
        """The inner sampler's metrics, then one synthesis tick's."""
        m = self.inner.metrics()
        m.update(self.synth_tick())
        return m  # type: ignore[no-any-return]

    def state_dict(self) -> dict[str, Any]:
        return {
            "inner": self.inner.state_dict(),
            "synth": {
                "tick": self.tick,
                "admitted": self.admitted,
                "pending": self.pending,
                "totals": dict(self.totals),
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Re-admit the saved tasks, then restore the inner sampler (its pool outcomes of those
        tasks included); a request in flight is started again now (it is admitted at its due
        tick). A state without ``synth`` (a run started without synthesis) is the inner's."""
        if "synth" not in state and "inner" not in state:
            state = {"inner": state}
        s = state.get("synth", {})
        self.tick = int(s.get("tick", 0))
        self.admitted = list(s.get("admitted", []))
        for t in map(self.proposer.load, self.admitted):
            level = self.proposer.level_of(t)
            self._admit([t], 0 if level is None else level)
        self.pending, self._future = s.get("pending"), None
        self.totals = Counter(s.get("totals", {}))
        self.inner.load_state_dict(state.get("inner", {}))
        if self.pending is not None:
            self._submit(self.pending["request"])
