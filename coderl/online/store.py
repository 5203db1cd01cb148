"""Storage for production interactions: one SQL schema, SQLite (WAL) or PostgreSQL.

The same code runs on both through SQLAlchemy Core; idempotent writes use each dialect's
``INSERT ... ON CONFLICT`` upsert. Tables:

- ``policy_versions``: weight versions that served traffic (lineage, status).
- ``interactions``: one row per chat completion: exact prompt/completion token ids, per-token
  behaviour logprobs, sampling settings, policy version, the adapter served (``shared@v3``,
  ``org-a@v5``: the route and its version), whether it was exploration traffic, the detected
  action.
- ``feedback_events``: append-only outcome events, primary key = the client's ``event_id`` (the
  same id twice stores one row). Events may arrive before their interaction; they are held here
  and joined when it arrives, or counted as orphans after a window.
- ``rejected_events``: malformed events with the reason (kept for audit and counting); a
  rejected imported line is keyed by its source, line number and content, so a replayed import
  counts it once.
- ``counters``: ingestion counters (duplicates...).
- ``rewards``: derived rewards per (interaction, reward-spec version); recomputable from events.
- ``training_batches`` / ``batch_items``: claimed batches; an interaction is claimed at most once.
- ``baseline_state``: running per-segment reward baselines.

Times are Unix seconds (float). Limits: no schema migrations (a changed schema needs a new
database); JSON columns hold token ids, which is fine for the sizes here but not compact.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from coderl.online.events import Rejected, _Event, read_jsonl

META = sa.MetaData()

POLICY_VERSIONS = sa.Table(
    "policy_versions",
    META,
    sa.Column("version", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("parent", sa.Integer, nullable=True),
    sa.Column("checkpoint", sa.Text, nullable=False),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("promoted_at", sa.Float, nullable=True),
)

INTERACTIONS = sa.Table(
    "interactions",
    META,
    sa.Column("interaction_id", sa.String(128), primary_key=True),
    sa.Column("episode_id", sa.String(128), nullable=False, index=True),
    sa.Column("population", sa.String(128), nullable=False),
    sa.Column("policy_version", sa.Integer, nullable=False, index=True),
    sa.Column("created_at", sa.Float, nullable=False, index=True),
    sa.Column("temperature", sa.Float, nullable=False),
    sa.Column("top_p", sa.Float, nullable=False),
    sa.Column("max_new_tokens", sa.Integer, nullable=False),
    sa.Column("seed", sa.BigInteger, nullable=True),
    sa.Column("prompt_token_ids", sa.JSON, nullable=False),
    sa.Column("completion_token_ids", sa.JSON, nullable=False),
    sa.Column("behaviour_logprobs", sa.JSON, nullable=True),
    sa.Column("finish_reason", sa.String(16), nullable=False),
    sa.Column("action", sa.String(16), nullable=False),
    sa.Column("tool_call_status", sa.String(16), nullable=False),
    sa.Column("is_summary", sa.Boolean, nullable=False, default=False),
    sa.Column("adapter", sa.String(160), nullable=False, default="shared"),
    sa.Column("exploration", sa.Boolean, nullable=False, default=False),
    sa.Column("server_latency_ms", sa.Float, nullable=False),
    sa.Column("request", sa.JSON, nullable=False),
    sa.Column("response_text", sa.Text, nullable=False),
)

FEEDBACK_EVENTS = sa.Table(
    "feedback_events",
    META,
    sa.Column("event_id", sa.String(128), primary_key=True),
    sa.Column("interaction_id", sa.String(128), nullable=False, index=True),
    sa.Column("type", sa.String(32), nullable=False),
    sa.Column("payload", sa.JSON, nullable=False),
    sa.Column("occurred_at", sa.Float, nullable=False),
    sa.Column("received_at", sa.Float, nullable=False),
)

REJECTED_EVENTS = sa.Table(
    "rejected_events",
    META,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("key", sa.String(64), nullable=False, unique=True),
    sa.Column("category", sa.String(32), nullable=False),
    sa.Column("reason", sa.Text, nullable=False),
    sa.Column("raw", sa.Text, nullable=False),
    sa.Column("received_at", sa.Float, nullable=False),
)

COUNTERS = sa.Table(
    "counters",
    META,
    sa.Column("name", sa.String(64), primary_key=True),
    sa.Column("value", sa.BigInteger, nullable=False),
)

REWARDS = sa.Table(
    "rewards",
    META,
    sa.Column("interaction_id", sa.String(128), primary_key=True),
    sa.Column("spec_version", sa.String(32), primary_key=True),
    sa.Column("episode_id", sa.String(128), nullable=False),
    sa.Column("status", sa.String(16), nullable=False),  # scored | censored
    sa.Column("reward", sa.Float, nullable=True),
    sa.Column("terms", sa.JSON, nullable=False),
    sa.Column("computed_at", sa.Float, nullable=False),
)

TRAINING_BATCHES = sa.Table(
    "training_batches",
    META,
    sa.Column("batch_id", sa.String(64), primary_key=True),
    sa.Column("spec_version", sa.String(32), nullable=False),
    sa.Column("claimed_by", sa.String(128), nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("n_items", sa.Integer, nullable=False),
)

BATCH_ITEMS = sa.Table(
    "batch_items",
    META,
    sa.Column("interaction_id", sa.String(128), primary_key=True),
    sa.Column("batch_id", sa.String(64), nullable=False, index=True),
)

BASELINE_STATE = sa.Table(
    "baseline_state",
    META,
    sa.Column("segment", sa.String(128), primary_key=True),
    sa.Column("value", sa.Float, nullable=False),
    sa.Column("count", sa.Integer, nullable=False),
)


def interaction_row(
    interaction_id: str,
    *,
    policy_version: int,
    created_at: float,
    prompt_token_ids: list[int],
    completion_token_ids: list[int],
    behaviour_logprobs: list[float] | None,
    temperature: float,
    episode_id: str | None = None,
    population: str = "default",
    action: str = "none",
    tool_call_status: str = "none",
    **extra: Any,
) -> dict[str, Any]:
    """One ``interactions`` row with defaults for the audit fields.

    ``action`` is ``edit``, ``clarify``, ``tool`` (a non-edit tool call) or ``none``;
    ``tool_call_status`` is ``none``, ``valid`` or ``invalid``.

    Raises:
        ValueError: behaviour logprobs whose length differs from the completion's.
    """
    if behaviour_logprobs is not None and len(behaviour_logprobs) != len(completion_token_ids):
        raise ValueError(
            f"{len(behaviour_logprobs)} behaviour logprobs for {len(completion_token_ids)} "
            "completion tokens"
        )
    row: dict[str, Any] = {
        "interaction_id": interaction_id,
        "episode_id": episode_id or interaction_id,
        "population": population,
        "policy_version": policy_version,
        "created_at": created_at,
        "temperature": temperature,
        "top_p": 1.0,
        "max_new_tokens": len(completion_token_ids),
        "seed": None,
        "prompt_token_ids": prompt_token_ids,
        "completion_token_ids": completion_token_ids,
        "behaviour_logprobs": behaviour_logprobs,
        "finish_reason": "stop",
        "action": action,
        "tool_call_status": tool_call_status,
        "is_summary": False,
        "adapter": f"shared@v{policy_version}",
        "exploration": False,
        "server_latency_ms": 0.0,
        "request": {},
        "response_text": "",
    }
    unknown = set(extra) - set(INTERACTIONS.c.keys())
    if unknown:
        raise ValueError(f"unknown interaction fields {sorted(unknown)}")
    row.update(extra)
    return row


@dataclass
class IngestResult:
    """What one ingestion call did."""

    stored: int = 0
    """New event rows written."""
    duplicates: int = 0
    """Events whose ``event_id`` was already stored (not written again)."""
    rejected: Counter[str] = field(default_factory=Counter)
    """Malformed events by reason category (``invalid_json``, ``invalid_event``...)."""
    reasons: list[str] = field(default_factory=list)
    """Full reason of each rejected event, in input order."""


def _set_sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: durable across process crashes
    cur.execute("PRAGMA busy_timeout=10000")
    cur.close()


class Store:
    """Interactions, events, rewards and batches in one SQL database.

    Args:
        url: SQLAlchemy URL, e.g. ``sqlite:///runs/online/online.db`` or
            ``postgresql+psycopg://user@127.0.0.1:5432/coderl``.

    Raises:
        ValueError: a dialect other than sqlite or postgresql.
    """

    def __init__(self, url: str) -> None:
        dialect = sa.engine.make_url(url).get_backend_name()
        if dialect not in _INSERTS:
            raise ValueError(f"unsupported database {dialect!r}; valid: {sorted(_INSERTS)}")
        self.url = url
        self.dialect = dialect
        kwargs: dict[str, Any] = {}
        if dialect == "sqlite":
            kwargs["connect_args"] = {"check_same_thread": False, "timeout": 10}
        self.engine = sa.create_engine(url, **kwargs)
        if dialect == "sqlite":
            sa.event.listen(self.engine, "connect", _set_sqlite_pragmas)
        META.create_all(self.engine)

    def close(self) -> None:
        self.engine.dispose()

    def _insert(self, table: sa.Table) -> Any:
        return _INSERTS[self.dialect](table)

    # -- policy versions and interactions -------------------------------------------------
    def add_policy_version(
        self, version: int, checkpoint: str, *, parent: int | None, status: str, now: float
    ) -> None:
        """Insert or update a policy version row (status: champion, candidate, retired,
        rejected)."""
        stmt = self._insert(POLICY_VERSIONS).values(
            version=version, parent=parent, checkpoint=checkpoint, status=status, created_at=now
        )
        stmt = stmt.on_conflict_do_update(
            index_elements=["version"], set_={"status": status, "checkpoint": checkpoint}
        )
        with self.engine.begin() as c:
            c.execute(stmt)

    def set_version_status(self, version: int, status: str, *, now: float) -> None:
        values: dict[str, Any] = {"status": status}
        if status == "champion":
            values["promoted_at"] = now
        with self.engine.begin() as c:
            c.execute(POLICY_VERSIONS.update().where(POLICY_VERSIONS.c.version == version), values)

    def policy_versions(self) -> list[dict[str, Any]]:
        with self.engine.connect() as c:
            rows = c.execute(POLICY_VERSIONS.select().order_by(POLICY_VERSIONS.c.version))
            return [dict(r._mapping) for r in rows]

    def record_interaction(self, row: dict[str, Any]) -> bool:
        """Store one interaction; returns False when its id was already stored."""
        stmt = self._insert(INTERACTIONS).values(**row)
        stmt = stmt.on_conflict_do_nothing(index_elements=["interaction_id"])
        with self.engine.begin() as c:
            return _inserted(c, stmt, INTERACTIONS.c.interaction_id)

    def interactions(
        self,
        *,
        since: float | None = None,
        until: float | None = None,
        ids: Sequence[str] | None = None,
        episode_ids: Sequence[str] | None = None,
    ) -> list[dict[str, Any]]:
        """Interaction rows, oldest first, filtered by creation time, ids or episode ids."""
        q = INTERACTIONS.select().order_by(INTERACTIONS.c.created_at)
        if since is not None:
            q = q.where(INTERACTIONS.c.created_at >= since)
        if until is not None:
            q = q.where(INTERACTIONS.c.created_at < until)
        if ids is not None:
            q = q.where(INTERACTIONS.c.interaction_id.in_(list(ids)))
        if episode_ids is not None:
            q = q.where(INTERACTIONS.c.episode_id.in_(list(episode_ids)))
        with self.engine.connect() as c:
            return [dict(r._mapping) for r in c.execute(q)]

    # -- feedback events ------------------------------------------------------------------
    def ingest(
        self, events: Iterable[_Event | Rejected], *, now: float | None = None
    ) -> IngestResult:
        """Store parsed events idempotently in one transaction; count rejects and duplicates.

        An event whose ``event_id`` is already stored is not written again (its first version
        wins). Malformed events (:class:`Rejected`) are stored in ``rejected_events`` with the
        reason and never raise; one with a ``key`` already stored is not stored again (the
        result still lists it: it is what this call saw).
        """
        now = time.time() if now is None else now
        res = IngestResult()
        rows: dict[str, dict[str, Any]] = {}  # event_id -> row; the first one in input wins
        with self.engine.begin() as c:
            for ev in events:
                if isinstance(ev, Rejected):
                    category = ev.reason.split(":", 1)[0]
                    res.rejected[category] += 1
                    res.reasons.append(f"line {ev.line}: {ev.reason}" if ev.line else ev.reason)
                    stmt = self._insert(REJECTED_EVENTS).values(
                        key=ev.key or uuid.uuid4().hex,
                        category=category,
                        reason=ev.reason,
                        raw=ev.raw,
                        received_at=now,
                    )
                    c.execute(stmt.on_conflict_do_nothing(index_elements=["key"]))
                elif ev.event_id in rows:
                    res.duplicates += 1
                else:
                    payload = ev.model_dump(exclude={"event_id", "interaction_id", "occurred_at"})
                    rows[ev.event_id] = {
                        "event_id": ev.event_id,
                        "interaction_id": ev.interaction_id,
                        "type": payload["type"],
                        "payload": payload,
                        "occurred_at": ev.occurred_at if ev.occurred_at is not None else now,
                        "received_at": now,
                    }
            if rows:
                # one multi-row INSERT ... ON CONFLICT DO NOTHING RETURNING: only new rows return
                stmt = self._insert(FEEDBACK_EVENTS).on_conflict_do_nothing(
                    index_elements=["event_id"]
                )
                stored = c.execute(stmt.returning(FEEDBACK_EVENTS.c.event_id), list(rows.values()))
                res.stored = len(stored.all())
                res.duplicates += len(rows) - res.stored
            if res.duplicates:
                self._bump(c, "duplicate_events", res.duplicates)
        return res

    def import_jsonl(
        self, path: str | Path, *, batch_size: int = 500, now: float | None = None
    ) -> IngestResult:
        """Batch-import a JSONL file of events, one transaction per ``batch_size`` lines.

        Safe to replay after a crash: committed batches are skipped by the ``event_id`` key
        (rejected lines by their line key), a batch interrupted mid-transaction was rolled back
        and is written again.

        Raises:
            FileNotFoundError: the file does not exist.
        """
        total = IngestResult()
        chunk: list[_Event | Rejected] = []
        for ev in read_jsonl(path):
            chunk.append(ev)
            if len(chunk) >= batch_size:
                _merge(total, self.ingest(chunk, now=now))
                chunk = []
        if chunk:
            _merge(total, self.ingest(chunk, now=now))
        return total

    def _bump(self, c: sa.Connection, name: str, n: int) -> None:
        stmt = self._insert(COUNTERS).values(name=name, value=n)
        stmt = stmt.on_conflict_do_update(
            index_elements=["name"], set_={"value": COUNTERS.c.value + n}
        )
        c.execute(stmt)

    def counter(self, name: str) -> int:
        with self.engine.connect() as c:
            v = c.execute(sa.select(COUNTERS.c.value).where(COUNTERS.c.name == name)).scalar()
        return int(v or 0)

    def rejected_counts(self) -> dict[str, int]:
        """Malformed events stored so far, by reason category."""
        q = sa.select(REJECTED_EVENTS.c.category, sa.func.count()).group_by(
            REJECTED_EVENTS.c.category
        )
        with self.engine.connect() as c:
            return {cat: int(n) for cat, n in c.execute(q)}

    def events_for(self, interaction_ids: Sequence[str]) -> dict[str, list[dict[str, Any]]]:
        """Stored events per interaction id, in arrival order."""
        out: dict[str, list[dict[str, Any]]] = {i: [] for i in interaction_ids}
        if not interaction_ids:
            return out
        q = (
            FEEDBACK_EVENTS.select()
            .where(FEEDBACK_EVENTS.c.interaction_id.in_(list(interaction_ids)))
            .order_by(FEEDBACK_EVENTS.c.received_at, FEEDBACK_EVENTS.c.event_id)
        )
        with self.engine.connect() as c:
            for r in c.execute(q):
                out[r.interaction_id].append(dict(r._mapping))
        return out

    def event_count(self) -> int:
        with self.engine.connect() as c:
            return int(
                c.execute(sa.select(sa.func.count()).select_from(FEEDBACK_EVENTS)).scalar_one()
            )

    def event_ids(self) -> list[str]:
        with self.engine.connect() as c:
            return [r[0] for r in c.execute(sa.select(FEEDBACK_EVENTS.c.event_id))]

    def unjoined_events(self) -> list[dict[str, Any]]:
        """Events whose interaction has not arrived (yet): held, not dropped."""
        known = sa.select(INTERACTIONS.c.interaction_id)
        q = FEEDBACK_EVENTS.select().where(FEEDBACK_EVENTS.c.interaction_id.not_in(known))
        with self.engine.connect() as c:
            return [dict(r._mapping) for r in c.execute(q)]

    # -- rewards, batches, baselines ------------------------------------------------------
    def upsert_rewards(self, rows: Sequence[dict[str, Any]]) -> None:
        """Write derived rewards; a recomputation replaces the previous value."""
        if not rows:
            return
        with self.engine.begin() as c:
            for row in rows:
                stmt = self._insert(REWARDS).values(**row)
                stmt = stmt.on_conflict_do_update(
                    index_elements=["interaction_id", "spec_version"],
                    set_={k: row[k] for k in ("status", "reward", "terms", "computed_at")},
                )
                c.execute(stmt)

    def rewards(
        self, spec_version: str, *, ids: Sequence[str] | None = None
    ) -> dict[str, dict[str, Any]]:
        q = REWARDS.select().where(REWARDS.c.spec_version == spec_version)
        if ids is not None:
            q = q.where(REWARDS.c.interaction_id.in_(list(ids)))
        with self.engine.connect() as c:
            return {r.interaction_id: dict(r._mapping) for r in c.execute(q)}

    def unclaimed_scored(self, spec_version: str) -> list[str]:
        """Ids of interactions scored under ``spec_version`` and not claimed by any batch."""
        claimed = sa.select(BATCH_ITEMS.c.interaction_id)
        q = (
            sa.select(REWARDS.c.interaction_id)
            .where(REWARDS.c.spec_version == spec_version, REWARDS.c.status == "scored")
            .where(REWARDS.c.interaction_id.not_in(claimed))
            .order_by(REWARDS.c.interaction_id)
        )
        with self.engine.connect() as c:
            return [r[0] for r in c.execute(q)]

    def claim_batch(
        self, spec_version: str, interaction_ids: Sequence[str], *, claimed_by: str, now: float
    ) -> tuple[str, list[str]]:
        """Claim interactions for one training batch (one spec version by construction).

        Ids already claimed by another batch are skipped (a concurrent claimer loses them).

        Returns:
            ``(batch_id, claimed_ids)``.
        """
        batch_id = uuid.uuid4().hex
        got: list[str] = []
        with self.engine.begin() as c:
            for iid in interaction_ids:
                stmt = self._insert(BATCH_ITEMS).values(interaction_id=iid, batch_id=batch_id)
                stmt = stmt.on_conflict_do_nothing(index_elements=["interaction_id"])
                if _inserted(c, stmt, BATCH_ITEMS.c.interaction_id):
                    got.append(iid)
            c.execute(
                TRAINING_BATCHES.insert().values(
                    batch_id=batch_id,
                    spec_version=spec_version,
                    claimed_by=claimed_by,
                    created_at=now,
                    n_items=len(got),
                )
            )
        return batch_id, got

    def release_batch(self, batch_id: str) -> int:
        """Un-claim a batch whose training failed, so its interactions can be claimed again.

        Returns:
            the number of interactions released.
        """
        with self.engine.begin() as c:
            n = c.execute(BATCH_ITEMS.delete().where(BATCH_ITEMS.c.batch_id == batch_id)).rowcount
            c.execute(TRAINING_BATCHES.delete().where(TRAINING_BATCHES.c.batch_id == batch_id))
        return int(n)

    def baseline(self, segment: str) -> tuple[float, int]:
        """Running baseline ``(value, count)`` for a segment; ``(0.0, 0)`` when unseen."""
        q = sa.select(BASELINE_STATE.c.value, BASELINE_STATE.c.count).where(
            BASELINE_STATE.c.segment == segment
        )
        with self.engine.connect() as c:
            r = c.execute(q).first()
        return (float(r[0]), int(r[1])) if r else (0.0, 0)

    def set_baseline(self, segment: str, value: float, count: int) -> None:
        stmt = self._insert(BASELINE_STATE).values(segment=segment, value=value, count=count)
        stmt = stmt.on_conflict_do_update(
            index_elements=["segment"], set_={"value": value, "count": count}
        )
        with self.engine.begin() as c:
            c.execute(stmt)


def _inserted(c: sa.Connection, stmt: Any, key: sa.Column[Any]) -> bool:
    """Run an ``INSERT ... ON CONFLICT DO NOTHING``; True when a row was written.

    Uses ``RETURNING`` (both dialects support it), since ``rowcount`` is not reliable across
    drivers for this statement.
    """
    return c.execute(stmt.returning(key)).first() is not None


def _merge(total: IngestResult, part: IngestResult) -> None:
    total.stored += part.stored
    total.duplicates += part.duplicates
    total.rejected.update(part.rejected)
    total.reasons.extend(part.reasons)


_INSERTS: dict[str, Any] = {"sqlite": sqlite.insert, "postgresql": postgresql.insert}


def dumps(obj: Any) -> str:
    """Compact JSON for logs and reports."""
    return json.dumps(obj, separators=(",", ":"), default=str)
