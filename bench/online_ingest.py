"""Event ingestion throughput: one multi-row upsert per batch (``Store.ingest``) vs the naive
baseline of one ``INSERT ... ON CONFLICT DO NOTHING`` transaction per event, measured in the same
run on the same events, on SQLite (WAL) and, when it can start, a throwaway local PostgreSQL.

Half of the events of the second pass are replays (duplicates), as after a client retry.

    .venv/bin/python bench/online_ingest.py            # 5000 events
    .venv/bin/python bench/online_ingest.py --events 20000 --batch 500
"""

from __future__ import annotations

import argparse
import tempfile
import time
import uuid

from rich.console import Console
from rich.table import Table

from coderl.online import pg_local
from coderl.online.events import parse_event
from coderl.online.store import FEEDBACK_EVENTS, Store


def _events(n: int, tag: str) -> list:
    return [
        parse_event(
            {
                "event_id": f"{tag}-{i}",
                "interaction_id": f"i{i % 97}",
                "type": "follow_up",
                "sentiment": "neutral",
            }
        )
        for i in range(n)
    ]


def per_event(store: Store, events: list) -> float:
    """Baseline: one transaction and one statement per event."""
    t = time.perf_counter()
    for ev in events:
        payload = ev.model_dump(exclude={"event_id", "interaction_id", "occurred_at"})
        stmt = (
            store._insert(FEEDBACK_EVENTS)
            .values(
                event_id=ev.event_id,
                interaction_id=ev.interaction_id,
                type=payload["type"],
                payload=payload,
                occurred_at=0.0,
                received_at=0.0,
            )
            .on_conflict_do_nothing(index_elements=["event_id"])
        )
        with store.engine.begin() as c:
            c.execute(stmt)
    return time.perf_counter() - t


def batched(store: Store, events: list, batch: int) -> float:
    t = time.perf_counter()
    for i in range(0, len(events), batch):
        store.ingest(events[i : i + batch], now=0.0)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=5000)
    ap.add_argument("--batch", type=int, default=200)
    args = ap.parse_args()
    urls = {"sqlite": f"sqlite:///{tempfile.mkdtemp()}/bench.db"}
    pg = None
    try:
        pg = pg_local.start(tempfile.mkdtemp(prefix="coderl-pg-"))
        urls["postgresql"] = pg.create_database(f"b_{uuid.uuid4().hex[:8]}")
    except pg_local.PostgresUnavailable as e:
        print(f"PostgreSQL skipped: {e}")
    table = Table(title=f"ingesting {args.events} events (+{args.events // 2} replays)")
    for col in ("database", "per-event txn (ev/s)", f"batched x{args.batch} (ev/s)", "speed-up"):
        table.add_column(col)
    try:
        for name, url in urls.items():
            store = Store(url)
            n = args.events
            fresh_a, fresh_b = _events(n, "a"), _events(n, "b")
            t_base = per_event(store, fresh_a) + per_event(store, fresh_a[: n // 2])
            t_ours = batched(store, fresh_b, args.batch) + batched(
                store, fresh_b[: n // 2], args.batch
            )
            assert store.event_count() == 2 * n
            total = n + n // 2
            table.add_row(
                name, f"{total / t_base:,.0f}", f"{total / t_ours:,.0f}", f"{t_base / t_ours:.1f}x"
            )
            store.close()
    finally:
        if pg is not None:
            pg.stop()
    Console().print(table)


if __name__ == "__main__":
    main()
