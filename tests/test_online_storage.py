"""Storage of production interactions on SQLite (WAL) and on a real PostgreSQL.

The PostgreSQL cluster is started by this module (initdb + pg_ctl on a temp dir, loopback port);
where it cannot start the PostgreSQL cases are skipped with the reason printed loudly.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from coderl.online import pg_local
from coderl.online.events import parse_event
from coderl.online.rewards import RewardSpec, finalize
from coderl.online.store import Store, interaction_row

T0 = 1_000_000.0


@pytest.fixture(scope="module")
def pg():
    # not under pytest's tmp dir: its 0700 parents are not traversable by the postgres user
    try:
        cluster = pg_local.start(tempfile.mkdtemp(prefix="coderl-pg-"))
    except pg_local.PostgresUnavailable as e:
        print(f"\n*** PostgreSQL could not start; PostgreSQL storage tests SKIPPED: {e}\n")
        yield None
        return
    yield cluster
    cluster.stop()


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path, pg) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'online.db'}"
    if pg is None:
        pytest.skip("PostgreSQL unavailable (see the loud message above)")
    return pg.create_database(f"t_{uuid.uuid4().hex[:12]}")


@pytest.fixture
def store(db_url: str):
    s = Store(db_url)
    yield s
    s.close()


def _interaction(iid: str, **kw) -> dict:
    kw.setdefault("created_at", T0)
    return interaction_row(
        iid,
        policy_version=kw.pop("policy_version", 0),
        prompt_token_ids=[1, 2, 3],
        completion_token_ids=[4, 5],
        behaviour_logprobs=[-0.5, -1.0],
        temperature=1.0,
        **kw,
    )


def _ev(eid: str, iid: str = "i1", **kw) -> dict:
    return {"event_id": eid, "interaction_id": iid, "type": "accepted", **kw}


def test_sqlite_uses_wal(tmp_path: Path) -> None:
    s = Store(f"sqlite:///{tmp_path / 'x.db'}")
    with s.engine.connect() as c:
        assert c.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"


def test_duplicate_events_store_one_row(store: Store) -> None:
    res = store.ingest([parse_event(_ev("e1")), parse_event(_ev("e1")), parse_event(_ev("e2"))])
    assert (res.stored, res.duplicates) == (2, 1)
    res2 = store.ingest([parse_event(_ev("e1", occurred_at=5.0))])  # same id, later replay
    assert (res2.stored, res2.duplicates) == (0, 1)
    assert sorted(store.event_ids()) == ["e1", "e2"]
    assert store.counter("duplicate_events") == 2


def test_malformed_events_rejected_with_reason_and_counted(store: Store) -> None:
    raw = [
        b"{not json",
        "[1, 2]",
        {"event_id": "e1", "interaction_id": "i1", "type": "teleported"},
        {
            "event_id": "e2",
            "interaction_id": "i1",
            "type": "edit_persisted",
            "fraction": 1.5,
            "after_minutes": 10,
        },
        {"event_id": "bad id!", "interaction_id": "i1", "type": "accepted"},
        {"event_id": "e3", "interaction_id": "i1", "type": "follow_up", "sentiment": "meh"},
        {"event_id": "e4", "interaction_id": "i1", "type": "accepted", "extra": 1},
        _ev("ok"),
    ]
    res = store.ingest([parse_event(r) for r in raw])
    assert res.stored == 1
    assert res.rejected == {"invalid_json": 1, "not_an_object": 1, "invalid_event": 5}
    assert any("fraction: must be at most 1" in r for r in res.reasons)
    assert store.rejected_counts() == {"invalid_json": 1, "not_an_object": 1, "invalid_event": 5}
    assert store.event_ids() == ["ok"]


def test_events_before_their_interaction_are_held_then_joined_or_orphaned(store: Store) -> None:
    spec = RewardSpec()
    store.ingest([parse_event(_ev("early", "late-arrival"))], now=T0)
    store.ingest([parse_event(_ev("lost", "never-arrives"))], now=T0)
    rep = finalize(store, spec, now=T0 + 10)
    assert (rep.held_events, rep.orphaned_events) == (2, 0)
    store.record_interaction(_interaction("late-arrival", action="edit", created_at=T0 + 5))
    rep = finalize(store, spec, now=T0 + spec.orphan_window_s + 3600 + 10)
    assert (rep.held_events, rep.orphaned_events) == (0, 1)
    # joined: the early "accepted" event scored the interaction (accept term +0.5)
    r = store.rewards(spec.version)["late-arrival"]
    assert r["status"] == "scored" and r["reward"] == pytest.approx(0.5)


def test_interaction_recorded_once(store: Store) -> None:
    assert store.record_interaction(_interaction("i1"))
    assert not store.record_interaction(_interaction("i1"))
    [row] = store.interactions()
    assert row["completion_token_ids"] == [4, 5] and row["behaviour_logprobs"] == [-0.5, -1.0]


def test_interaction_row_rejects_misaligned_logprobs() -> None:
    with pytest.raises(ValueError, match="2 behaviour logprobs for 3"):
        interaction_row(
            "x",
            policy_version=0,
            created_at=0.0,
            prompt_token_ids=[1],
            completion_token_ids=[1, 2, 3],
            behaviour_logprobs=[0.0, 0.0],
            temperature=1.0,
        )


def test_claimed_interactions_are_never_claimed_twice(store: Store) -> None:
    spec = RewardSpec()
    for i in range(4):
        store.record_interaction(_interaction(f"i{i}", action="edit"))
        store.ingest([parse_event(_ev(f"e{i}", f"i{i}"))], now=T0)
    finalize(store, spec, now=T0 + 10_000)
    ids = store.unclaimed_scored(spec.version)
    assert ids == ["i0", "i1", "i2", "i3"]
    b1, got = store.claim_batch(spec.version, ids[:3], claimed_by="a", now=T0)
    _, got2 = store.claim_batch(spec.version, ids, claimed_by="b", now=T0)
    assert got == ["i0", "i1", "i2"] and got2 == ["i3"]
    assert store.unclaimed_scored(spec.version) == []
    assert store.release_batch(b1) == 3  # training of that batch failed: claimable again
    assert store.unclaimed_scored(spec.version) == ["i0", "i1", "i2"]


_IMPORTER = """
import sys
from coderl.online.store import Store
Store(sys.argv[1]).import_jsonl(sys.argv[2], batch_size=int(sys.argv[3]))
"""


def test_kill9_during_ingestion_then_replay_loses_and_duplicates_nothing(
    store: Store, tmp_path: Path
) -> None:
    n, batch = 6000, 50  # every 10th line is malformed: 45 events and 5 rejects per batch
    path = tmp_path / "events.jsonl"
    with open(path, "w") as f:
        for i in range(n):
            bad = i % 10 == 9
            f.write(
                f"{{bad line {i}\n" if bad else json.dumps(_ev(f"ev-{i:05d}", f"i{i % 50}")) + "\n"
            )
    proc = subprocess.Popen(
        [sys.executable, "-c", _IMPORTER, store.url, str(path), str(batch)],
        env={**os.environ, "PYTHONPATH": str(Path.cwd())},
    )
    deadline = time.time() + 60
    while store.event_count() < 2 * 45 and time.time() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    mid, good = store.event_count(), n - n // 10
    assert 0 < mid < good, f"kill landed outside the import ({mid} of {good} stored)"
    assert mid % 45 == 0, "a partially committed batch survived the kill"
    assert store.rejected_counts() == {"invalid_json": mid // 45 * 5}  # committed with its batch
    res = store.import_jsonl(path, batch_size=batch)  # replay the whole file
    assert res.stored == good - mid and res.duplicates == mid
    ids = store.event_ids()
    assert len(ids) == len(set(ids)) == good
    # each malformed line is counted once, although the replay read the committed ones again
    assert store.rejected_counts() == {"invalid_json": n // 10}
    store.import_jsonl(path, batch_size=batch)
    assert store.rejected_counts() == {"invalid_json": n // 10}


def test_imported_events_get_the_same_limits_as_posted_ones(store: Store, tmp_path: Path) -> None:
    ev = _ev("lim-1", "i1")
    lines = [
        json.dumps({**ev, "occurred_at": True}),
        json.dumps({**ev, "occurred_at": 1}).replace('": 1', '": 1e999'),
        "[" * 5000 + "]" * 5000,
        json.dumps(ev),
    ]
    path = tmp_path / "ev.jsonl"
    path.write_text("\n".join(lines) + "\n")
    res = store.import_jsonl(path)
    assert res.stored == 1 and res.rejected == {"invalid_event": 2, "too_deep": 1}
    assert "expected a number, got the boolean true" in res.reasons[0]
    assert "occurred_at: must be a finite number" in res.reasons[1]


def test_import_rejections_name_their_line(tmp_path):
    store = Store(f"sqlite:///{tmp_path / 'db.sqlite'}")
    path = tmp_path / "events.jsonl"
    path.write_text('\n{"not": "an event"}\n{broken\n')
    res = store.import_jsonl(path)
    assert [r.split(":")[0] for r in res.reasons] == ["line 2", "line 3"], res.reasons
    assert sum(res.rejected.values()) == 2
