"""Which training tasks a step draws (``tasks.sampler``, ``tasks.mix``); one home for both drivers.

Every sampler is a stream of tasks: ``at(i)`` is the task at stream position ``i`` (what the async
ledger reads), ``take(n)`` the next ``n`` (what ``coderl train`` reads), and ``observe`` feeds
the outcomes of the episodes rolled out back in. :data:`SAMPLERS` names them:

- ``uniform`` (:class:`TaskSampler`): each epoch a fresh permutation seeded by (seed, epoch);
  outcomes are ignored. The default; a pure function of the position.
- ``pool`` (:class:`PoolSampler`): a difficulty-calibrated pool. Each task keeps its last
  ``pool.window`` outcomes, 1 where the episode's grade resolved the task, 0 where it did not
  (agent failures are 0; masked episodes, infra failures among them, are not counted). Their
  mean is the task's pass-rate estimate. A task is *active* when the estimate is strictly
  between 0 and 1, *retired* when at least ``pool.settle`` kept outcomes all resolved,
  *unsolved* when at least ``pool.settle`` all failed, *new* otherwise (unseen, or too few
  samples of one outcome). A draw is from the new tasks with probability ``pool.explore``,
  from the retired and unsolved with ``pool.revisit``, else from the active ones weighted by
  ``p (1 - p)`` (the variance of a resolved/failed episode, so tasks near 0.5 carry most
  signal); an empty class falls back to active, then new, then settled. A settled task that
  turns active again is counted as revived. The design follows prime-rl's difficulty pools
  (easy / normal / hard buffers of ``DifficultyPoolBuffer``), with per-task estimates.
- ``tasks.mix`` (:class:`MixSampler`): several sources, each drawn by its own ``uniform`` or
  ``pool`` sampler; per block the slots go to sources by smooth weighted round-robin on the
  credit each accrues (``n x`` its scheduled share per block; ties broken by a seeded
  permutation), so the cumulative count of each source stays within about one task of its
  scheduled share. The schedule reads the training step (:attr:`step`, set by the driver); with
  ``tasks.curriculum`` the weights come instead from :class:`coderl.train.curriculum.Curriculum`
  (stages that advance by pass rate).
- ``tasks.synth`` wraps either in :class:`coderl.train.synth.SynthSampler`, which admits newly
  synthesised tasks to the pool (:meth:`PoolSampler.admit`, :meth:`MixSampler.admit`).

Pool and mix draw ``tasks.tasks_per_step`` positions at a time (a block): block ``b`` is drawn
the first time one of its positions is asked for, from a generator seeded by (seed, b) and the
state at that moment, and cached, so a re-issued position (an async re-sample, a resumed job)
gets the same task. In ``coderl train`` a step takes one block after the previous step's
outcomes were observed; ``coderl train-async`` at ``max_staleness=0`` issues the same block at
the same point, so both draw the same tasks. :meth:`state_dict` (outcomes, counters, cached
blocks, round-robin credits) is saved in every checkpoint and restored on ``--resume``.

:func:`coderl.train.signal.rollout_metrics` logs, per step and for the groups actually rolled out (before dynamic
sampling drops any): ``signal/groups`` and ``signal/groups_with_signal`` (the share with
non-zero reward variance over valid members); the sampler's ``pool/*`` and ``mix/*`` metrics.

Limits: in ``train-async`` with ``max_staleness > 0`` later blocks are drawn before earlier
groups are observed, and groups dropped as stale are not observed.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import numpy as np

from coderl.config import Config, MixSourceConfig, PoolConfig
from coderl.train.curriculum import Curriculum
from coderl.train.synth import SynthSampler

STATUSES = ("active", "new", "retired", "unsolved")


class TaskSource(Protocol):
    """What a driver needs of a task sampler (see the module docstring)."""

    position: int
    """Tasks handed out by :meth:`take` so far (``coderl train``'s data cursor)."""
    step: int
    """The training step whose tasks are drawn next (the mix schedule reads it)."""

    def at(self, i: int) -> tuple[str, Any]:
        """``(task.id, task)`` at stream position ``i`` (the cursor does not move)."""
        ...

    def take(self, n: int) -> list[tuple[int, Any]]:
        """The next ``n`` ``(position, task)``; advances :attr:`position`."""
        ...

    def observe(self, tasks: list[Any], infos: list[dict[str, Any]]) -> None:
        """Outcomes of rolled-out episodes: per episode its task and its
        :func:`coderl.train.pipeline.episode_info` (``valid``, ``resolved`` are read)."""
        ...

    def metrics(self) -> dict[str, float]:
        """The sampler's state as metrics (``pool/*``, ``mix/*``); resets per-step counters."""
        ...

    def source_of(self, task: Any) -> str | None:
        """The mix entry a task comes from (None outside a mix)."""
        ...

    def prepass_tasks(self) -> list[Any]:
        """Tasks whose estimates a pre-pass seeds (the pool's; none for ``uniform``)."""
        ...

    def forget_before(self, i: int) -> None:
        """Drop what no position below ``i`` needs any more (cached blocks)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Plain-JSON state beyond :attr:`position` (empty for ``uniform``)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        ...


class TaskSampler:
    """``uniform``: an endless stream of a split's tasks, each epoch a fresh permutation seeded
    by (seed, epoch). ``position`` (tasks handed out so far) is the whole data cursor; ``at(i)``
    is the i-th task of the stream (the async ledger's task stream).

    Raises:
        ValueError: ``tasks`` is empty.
    """

    def __init__(self, tasks: list[Any], seed: int, position: int = 0):
        if not tasks:
            raise ValueError("the training split holds no tasks")
        self.tasks, self.seed, self.position, self.step = tasks, seed, position, 0
        self._orders: dict[int, list[int]] = {}

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            rng = np.random.default_rng([self.seed, epoch])
            self._orders = {epoch: rng.permutation(len(self.tasks)).tolist()}
        return self._orders[epoch]

    def at(self, i: int) -> tuple[str, Any]:
        """``(task.id, task)`` of stream index ``i`` (does not move the cursor)."""
        epoch, pos = divmod(i, len(self.tasks))
        task = self.tasks[self._order(epoch)[pos]]
        return task.id, task

    def take(self, n: int) -> list[tuple[int, Any]]:
        """The next ``n`` tasks with their stream positions; advances the cursor."""
        out = [(self.position + k, self.at(self.position + k)[1]) for k in range(n)]
        self.position += n
        return out

    def next(self, n: int) -> list[Any]:
        """The next ``n`` tasks; advances the cursor."""
        return [t for _, t in self.take(n)]

    def observe(self, tasks: list[Any], infos: list[dict[str, Any]]) -> None:
        """Outcomes do not change a uniform stream."""

    def metrics(self) -> dict[str, float]:
        return {}

    def source_of(self, task: Any) -> str | None:
        return None

    def prepass_tasks(self) -> list[Any]:
        return []

    def forget_before(self, i: int) -> None:
        """Nothing is cached."""

    def state_dict(self) -> dict[str, Any]:
        return {}  # the cursor is the whole state (saved as ``cursor``)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing beyond the cursor."""


class _Blocks(ABC):
    """The block cache of :class:`PoolSampler` and :class:`MixSampler`: ``at`` draws block
    ``i // block`` with ``draw_block`` on first use."""

    block: int
    position: int
    _blocks: dict[int, list[Any]]

    @abstractmethod
    def _draw_block(self, b: int) -> list[Any]:
        """The entries of block ``b`` (drawn once, then cached)."""

    @abstractmethod
    def _task(self, entry: Any) -> Any:
        """The task a block entry names."""

    def at(self, i: int) -> tuple[str, Any]:
        """``(task.id, task)`` at stream position ``i`` (draws its block on first use)."""
        b, k = divmod(i, self.block)
        if b not in self._blocks:
            self._blocks[b] = self._draw_block(b)
        task = self._task(self._blocks[b][k])
        return task.id, task

    def take(self, n: int) -> list[tuple[int, Any]]:
        """The next ``n`` tasks with their stream positions; advances the cursor."""
        out = [(self.position + k, self.at(self.position + k)[1]) for k in range(n)]
        self.position += n
        self.forget_before(self.position)
        return out

    def forget_before(self, i: int) -> None:
        """Drop cached blocks that lie wholly before position ``i`` (never asked for again)."""
        self._blocks = {b: v for b, v in self._blocks.items() if (b + 1) * self.block > i}

    def _blocks_state(self) -> dict[str, Any]:
        return {str(b): v for b, v in sorted(self._blocks.items())}


class PoolSampler(_Blocks):
    """``pool``: the difficulty-calibrated pool of the module docstring over ``tasks``.

    Args:
        block: positions drawn together (``tasks.tasks_per_step``); within a block a task is
            drawn at most once while there are enough tasks.

    Raises:
        ValueError: ``tasks`` is empty.
    """

    def __init__(self, tasks: list[Any], seed: int, cfg: PoolConfig, block: int) -> None:
        if not tasks:
            raise ValueError("the training split holds no tasks")
        self.tasks, self.seed, self.cfg, self.block = tasks, seed, cfg, block
        self.by_id = {t.id: t for t in tasks}
        self.position, self.step = 0, 0
        self.outcomes: dict[str, list[int]] = {t.id: [] for t in tasks}
        """Task id -> its last ``window`` outcomes (1 resolved, 0 not), oldest first."""
        self.revived = 0
        """Settled (retired or unsolved) tasks that turned active again."""
        self.drawn: Counter[str] = Counter()
        """Draws by the status of the task when drawn, since the last :meth:`metrics`."""
        self._blocks: dict[int, list[Any]] = {}

    def status(self, task_id: str) -> str:
        """``active``, ``new``, ``retired`` or ``unsolved`` (see the module docstring)."""
        xs = self.outcomes[task_id]
        if 0 < sum(xs) < len(xs):
            return "active"
        if len(xs) >= self.cfg.settle:
            return "retired" if xs[0] == 1 else "unsolved"
        return "new"

    def estimate(self, task_id: str) -> float:
        """The task's pass-rate estimate (NaN: no outcome yet)."""
        xs = self.outcomes[task_id]
        return sum(xs) / len(xs) if xs else math.nan

    def draw(self, n: int, key: list[int]) -> list[str]:
        """``n`` task ids drawn from the current state with a generator seeded by
        ``[seed, *key]`` (distinct while the split has ``n`` tasks)."""
        rng = np.random.default_rng([self.seed, *key])
        by: dict[str, list[str]] = {s: [] for s in STATUSES}
        for t in self.tasks:
            by[self.status(t.id)].append(t.id)
        chosen: list[str] = []
        for _ in range(n):
            u = rng.random()
            first = (
                "settled"
                if u < self.cfg.revisit
                else "new"
                if u < self.cfg.revisit + self.cfg.explore
                else "active"
            )
            taken = set(chosen) if len(chosen) < len(self.tasks) else set()
            for kind in (first, "active", "new", "settled"):
                ids = by["retired"] + by["unsolved"] if kind == "settled" else by[kind]
                ids = [i for i in ids if i not in taken]
                if ids:
                    break
            if kind == "active":
                w = np.array([self.estimate(i) * (1 - self.estimate(i)) for i in ids])
                pick = ids[int(rng.choice(len(ids), p=w / w.sum()))]
            else:
                pick = ids[int(rng.integers(len(ids)))]
            self.drawn[self.status(pick)] += 1
            chosen.append(pick)
        return chosen

    def _draw_block(self, b: int) -> list[Any]:
        return self.draw(self.block, [b])

    def _task(self, entry: Any) -> Any:
        return self.by_id[entry]

    def observe(self, tasks: list[Any], infos: list[dict[str, Any]]) -> None:
        """Append each valid episode's outcome (``info["resolved"]``) to its task's window;
        masked episodes (``info["valid"]`` False) are skipped. Tasks not in the pool are
        ignored."""
        before = {t.id: self.status(t.id) for t in tasks if t.id in self.outcomes}
        for t, info in zip(tasks, infos, strict=True):
            if t.id in self.outcomes and info["valid"]:
                xs = self.outcomes[t.id]
                xs.append(int(bool(info["resolved"])))
                del xs[: -self.cfg.window]
        for tid, was in before.items():
            if was in ("retired", "unsolved") and self.status(tid) == "active":
                self.revived += 1

    def metrics(self) -> dict[str, float]:
        """``pool/{active,new,retired,unsolved}`` (tasks now), ``pool/unseen``, ``pool/mean``
        (mean estimate over seen tasks), ``pool/hist_<i>`` (seen tasks per estimate bin),
        ``pool/revived`` (so far) and ``pool/drawn_<status>`` (draws since the last call, by
        the task's status when drawn); resets the draw counts."""
        counts = Counter(self.status(t.id) for t in self.tasks)
        est = [self.estimate(t.id) for t in self.tasks if self.outcomes[t.id]]
        m = {f"pool/{s}": float(counts[s]) for s in STATUSES}
        m["pool/unseen"] = float(len(self.tasks) - len(est))
        m["pool/mean"] = float(np.mean(est)) if est else math.nan
        bins = self.cfg.bins
        hist = Counter(min(int(p * bins), bins - 1) for p in est)
        m.update({f"pool/hist_{i}": float(hist[i]) for i in range(bins)})
        m["pool/revived"] = float(self.revived)
        m.update({f"pool/drawn_{s}": float(self.drawn[s]) for s in STATUSES})
        self.drawn = Counter()
        return m

    def source_of(self, task: Any) -> str | None:
        return None

    def admit(self, tasks: list[Any]) -> list[Any]:
        """Add tasks (they start ``new``; ids already in the pool are skipped); returns those
        added. The synthesiser's hook."""
        added = [t for t in tasks if t.id not in self.by_id]
        for t in added:
            self.tasks.append(t)
            self.by_id[t.id], self.outcomes[t.id] = t, []
        return added

    def prepass_tasks(self) -> list[Any]:
        return self.tasks[: self.cfg.prepass_tasks]

    def state_dict(self) -> dict[str, Any]:
        return {
            "outcomes": {k: v for k, v in self.outcomes.items() if v},
            "revived": self.revived,
            "drawn": dict(self.drawn),
            "blocks": self._blocks_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (outcomes of tasks no longer in the split are dropped)."""
        self.outcomes = {t.id: [] for t in self.tasks}
        for k, v in state.get("outcomes", {}).items():
            if k in self.outcomes:
                self.outcomes[k] = [int(x) for x in v]
        self.revived = int(state.get("revived", 0))
        self.drawn = Counter(state.get("drawn", {}))
        self._blocks = {int(b): v for b, v in state.get("blocks", {}).items()}


def scheduled_weight(weight: float | list[tuple[int, float]], step: int) -> float:
    """A ``tasks.mix`` weight at ``step``: a constant, or ``(step, weight)`` points linearly
    interpolated (constant beyond the first and last point)."""
    if isinstance(weight, float | int):
        return float(weight)
    steps = [float(s) for s, _ in weight]
    return float(np.interp(step, steps, [float(w) for _, w in weight]))


class MixSampler(_Blocks):
    """``tasks.mix``: each block's slots split among sources by their scheduled weights (see
    the module docstring), each source drawing from its own sampler.

    Args:
        sources: per entry, its config and its training tasks.
        samplers: entry label -> ``uniform`` or ``pool`` (the entry's or ``tasks.sampler``).

    Raises:
        ValueError: a source has no tasks; (when drawing) every weight is 0 at the step.
    """

    def __init__(
        self,
        sources: list[tuple[MixSourceConfig, list[Any]]],
        samplers: Mapping[str, str],
        seed: int,
        pool: PoolConfig,
        block: int,
        curriculum: Curriculum | None = None,
    ) -> None:
        self.seed, self.block, self.position, self.step = seed, block, 0, 0
        self.curriculum = curriculum  # None: the entries' weight schedules
        self.entries = [m for m, _ in sources]
        self.labels = [m.label() for m in self.entries]
        self.subs: dict[str, TaskSampler | PoolSampler] = {}
        for k, (m, tasks) in enumerate(sources):
            sub_seed = seed * 7919 + k + 1
            self.subs[m.label()] = (
                PoolSampler(tasks, sub_seed, pool, block)
                if samplers[m.label()] == "pool"
                else TaskSampler(tasks, sub_seed)
            )
        self.owner = {t.id: m.label() for m, tasks in sources for t in tasks}
        self.by_id = {t.id: t for _, tasks in sources for t in tasks}
        self.credit = dict.fromkeys(self.labels, 0.0)
        """Label -> slots owed (scheduled minus drawn), the round-robin state."""
        self._blocks: dict[int, list[Any]] = {}

    def shares(self, step: int) -> dict[str, float]:
        """Label -> normalised scheduled weight at ``step``.

        Raises:
            ValueError: every weight is 0 at ``step``.
        """
        if self.curriculum is not None:
            w = self.curriculum.weights(self.labels)
        else:
            w = {m.label(): scheduled_weight(m.weight, step) for m in self.entries}
        total = sum(w.values())
        if total <= 0:
            raise ValueError(  # said from 1, as the step lines count; the schedule from 0
                f"tasks.mix: every source has weight 0 at step {step + 1} (schedule point "
                f"{step}: the weights' [step, weight] points count steps from 0)"
            )
        return {k: v / total for k, v in w.items()}

    def allocate(self, b: int) -> list[str]:
        """The source label of each of block ``b``'s slots (smooth weighted round-robin)."""
        shares = self.shares(self.step)
        tie = np.random.default_rng([self.seed, 0x313, b]).permutation(len(self.labels))
        live = [i for i, k in enumerate(self.labels) if shares[k] > 0]
        for k in self.labels:
            self.credit[k] += self.block * shares[k]
        out = []
        for _ in range(self.block):
            i = max(live, key=lambda i: (self.credit[self.labels[i]], -tie[i]))
            self.credit[self.labels[i]] -= 1.0
            out.append(self.labels[i])
        return sorted(out, key=self.labels.index)

    def _draw_block(self, b: int) -> list[Any]:
        slots = Counter(self.allocate(b))
        block: list[Any] = []
        for k, label in enumerate(self.labels):
            if not slots[label]:
                continue
            sub = self.subs[label]
            if isinstance(sub, PoolSampler):
                ids = sub.draw(slots[label], [b, k])
            else:
                ids = [t.id for _, t in sub.take(slots[label])]
            block.extend([label, i] for i in ids)
        return block

    def _task(self, entry: Any) -> Any:
        return self.by_id[entry[1]]

    def observe(self, tasks: list[Any], infos: list[dict[str, Any]]) -> None:
        """Each episode's outcome goes to its source's sampler (and to the curriculum)."""
        for label, sub in self.subs.items():
            idx = [i for i, t in enumerate(tasks) if self.owner.get(t.id) == label]
            sub.observe([tasks[i] for i in idx], [infos[i] for i in idx])
            if self.curriculum is not None:
                self.curriculum.observe(label, [infos[i] for i in idx])

    def admit(self, tasks: list[Any], label: str) -> list[Any]:
        """Add tasks to source ``label``'s pool (:meth:`PoolSampler.admit`); raises ValueError
        when ``label`` is not a pool source."""
        sub = self.subs.get(label)
        if not isinstance(sub, PoolSampler):
            raise ValueError(f"tasks.mix: {label!r} is not a pool source; cannot admit tasks")
        added = sub.admit([t for t in tasks if t.id not in self.by_id])
        for t in added:
            self.owner[t.id], self.by_id[t.id] = label, t
        return added

    def metrics(self) -> dict[str, float]:
        """``mix/<label>/weight`` (share scheduled at :attr:`step`) and each pool source's
        metrics as ``pool/<label>/...``."""
        m = {f"mix/{k}/weight": v for k, v in self.shares(self.step).items()}
        if self.curriculum is not None:
            m.update(self.curriculum.metrics())
        for label, sub in self.subs.items():
            m.update({f"pool/{label}/{k[5:]}": v for k, v in sub.metrics().items()})
        return m

    def source_of(self, task: Any) -> str | None:
        return self.owner.get(task.id)

    def prepass_tasks(self) -> list[Any]:
        return [t for sub in self.subs.values() for t in sub.prepass_tasks()]

    def state_dict(self) -> dict[str, Any]:
        cur = {"curriculum": self.curriculum.state_dict()} if self.curriculum else {}
        return {
            **cur,
            "credit": dict(self.credit),
            "blocks": self._blocks_state(),
            "sources": {
                k: {"position": s.position, **s.state_dict()} for k, s in self.subs.items()
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.credit = {k: float(state.get("credit", {}).get(k, 0.0)) for k in self.labels}
        self._blocks = {int(b): v for b, v in state.get("blocks", {}).items()}
        if self.curriculum is not None:
            self.curriculum.load_state_dict(state.get("curriculum", {}))
        for k, sub in self.subs.items():
            s = state.get("sources", {}).get(k, {})
            sub.position = int(s.get("position", 0))
            sub.load_state_dict(s)


SAMPLERS: dict[str, Callable[[list[Any], int, PoolConfig, int], TaskSampler | PoolSampler]] = {
    "uniform": lambda tasks, seed, pool, block: TaskSampler(tasks, seed),
    "pool": PoolSampler,
}
"""``tasks.sampler`` -> constructor (tasks, seed, pool config, block); the only dispatch point."""


def build_sampler(cfg: Config, env: Any) -> TaskSource:
    """The run's task sampler: :class:`MixSampler` with ``tasks.mix`` (``env`` is then a
    :class:`coderl.envs.mix.MixEnvironment`; ``tasks.curriculum`` sets its weights), else
    ``SAMPLERS[tasks.sampler]`` over the first ``tasks.limit`` tasks of ``tasks.train_split``;
    wrapped in :class:`coderl.train.synth.SynthSampler` with ``tasks.synth.enabled``.

    Raises:
        ValueError: a split (or a mix source) holds no tasks.
    """
    t = cfg.tasks
    if t.mix:
        sources = [(m, env.source_tasks(m.label(), t.train_split)[: m.limit]) for m in t.mix]
        for m, tasks in sources:
            if not tasks:
                raise ValueError(f"tasks.mix: source {m.label()!r} has no training tasks")
        samplers = {m.label(): m.sampler or t.sampler for m in t.mix}
        curriculum = Curriculum(t.curriculum) if t.curriculum is not None else None
        sampler: TaskSource = MixSampler(
            sources, samplers, cfg.seed, t.pool, t.tasks_per_step, curriculum
        )
    else:
        tasks = env.tasks(t.train_split)[: t.limit]
        sampler = SAMPLERS[t.sampler](tasks, cfg.seed, t.pool, t.tasks_per_step)
    if t.synth.enabled:
        sampler = SynthSampler(sampler, t.synth, cfg.seed)
    return sampler
