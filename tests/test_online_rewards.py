"""Reward spec, censoring, hack-closing by construction, and single-sample baselines."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from coderl.online.baselines import advantages, check_baseline
from coderl.online.events import parse_event
from coderl.online.rewards import RewardSpec, finalize, score_episode
from coderl.online.store import Store, interaction_row

T0 = 1_000_000.0
SPEC = RewardSpec()  # accept 0.5, persist 1.0, follow_up 0.5, latency 0.1 -> worst edit -2.1
CLOSED = T0 + 10_000  # every default window (max 3600 s) has closed


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(f"sqlite:///{tmp_path / 'r.db'}")


def _turn(iid: str, **kw) -> dict:
    kw.setdefault("created_at", T0)
    return interaction_row(
        iid,
        policy_version=0,
        prompt_token_ids=[1],
        completion_token_ids=[2],
        behaviour_logprobs=[-0.1],
        temperature=1.0,
        **kw,
    )


def _add(store: Store, iid: str, events: list[dict], *, received: float = T0, **kw) -> None:
    store.record_interaction(_turn(iid, **kw))
    store.ingest(
        [
            parse_event({"event_id": f"{iid}-{k}", "interaction_id": iid, **e})
            for k, e in enumerate(events)
        ],
        now=received,
    )


def test_edit_terms_hand_worked(store: Store) -> None:
    _add(
        store,
        "i",
        [
            {"type": "accepted"},
            {"type": "rejected"},
            {"type": "accepted"},  # a rejection dominates: 0.5 * -1
            {"type": "edit_persisted", "fraction": 0.75, "after_minutes": 30},  # 1.0 * (2*.75-1)
            {"type": "follow_up", "sentiment": "dissatisfied"},  # 0.5 * -1
            {"type": "latency_ms", "value": 15_000},  # -0.1 * 0.5
        ],
        action="edit",
    )
    finalize(store, SPEC, now=CLOSED)
    r = store.rewards("v1")["i"]
    # -0.5 + 0.5 - 0.5 - 0.05 = -0.55
    assert r["reward"] == pytest.approx(-0.55, abs=1e-9)
    assert r["terms"]["accept"] == pytest.approx(-0.5)
    assert r["terms"]["persist"] == pytest.approx(0.5)
    assert r["terms"]["latency"] == pytest.approx(-0.05)


# One adverse event against many favourable ones with fresh event ids (the eighth attack round:
# a mean of votes let ten ``accepted`` outvote one ``rejected``); each kind's term is its most
# adverse in-window value, once, whichever turn of the episode the events name.
ADVERSE = {
    "accept": ({"type": "accepted"}, {"type": "rejected"}, -0.5),
    "persist": (
        {"type": "edit_persisted", "fraction": 1.0, "after_minutes": 30},
        {"type": "edit_persisted", "fraction": 0.0, "after_minutes": 30},
        -1.0,
    ),
    "follow_up": (
        {"type": "follow_up", "sentiment": "satisfied"},
        {"type": "follow_up", "sentiment": "dissatisfied"},
        -0.5,
    ),
    "latency": (
        {"type": "latency_ms", "value": 0},
        {"type": "latency_ms", "value": 60_000},
        -0.1,
    ),
}


@pytest.mark.parametrize("term", sorted(ADVERSE))
@pytest.mark.parametrize("where", ["one_turn", "another_turn"])
def test_repeated_favourable_events_do_not_outvote_an_adverse_one(store, term, where):
    good, bad, want = ADVERSE[term]
    anchor = [] if term in ("accept", "persist", "follow_up") else [{"type": "accepted"}]
    _add(store, "a", [bad, *anchor], action="edit", episode_id="e")
    target = "a" if where == "one_turn" else "b"
    if target == "b":
        _add(store, "b", [], action="edit", episode_id="e")
    store.ingest(
        [
            parse_event({"event_id": f"rep-{k}", "interaction_id": target, **good})
            for k in range(10)
        ],
        now=T0,
    )
    finalize(store, SPEC, now=CLOSED)
    rows = store.rewards("v1")
    assert rows["a"]["terms"][term] == pytest.approx(want), rows["a"]["terms"]
    assert all(r["reward"] == rows["a"]["reward"] for r in rows.values())


def test_invalid_tool_call_is_kept_as_a_negative(store: Store) -> None:
    # no outcome event at all: an edit would be censored, a broken call is still scored
    _add(store, "broken", [], action="none", tool_call_status="invalid")
    _add(
        store,
        "client-err",
        [{"type": "tool_error", "message": "bad json"}, {"type": "accepted"}],
        action="edit",
        tool_call_status="valid",
    )
    rep = finalize(store, SPEC, now=CLOSED)
    rw = store.rewards("v1")
    assert rw["broken"]["status"] == "scored" and rw["broken"]["reward"] == -2.5
    assert rw["client-err"]["reward"] == -2.5  # a tool error outweighs the acceptance
    assert rep.by_kind == {"broken": 2}
    assert set(store.unclaimed_scored("v1")) == {"broken", "client-err"}


def test_edit_without_outcome_is_censored_never_zero(store: Store) -> None:
    _add(store, "quiet", [{"type": "latency_ms", "value": 10.0}], action="edit")
    rep = finalize(store, SPEC, now=T0 + 100)
    assert rep.pending == 1  # windows still open: not scored yet
    rep = finalize(store, SPEC, now=CLOSED)
    r = store.rewards("v1")["quiet"]
    assert (rep.censored, r["status"], r["reward"]) == (1, "censored", None)
    assert store.unclaimed_scored("v1") == []  # excluded from training


def test_late_events_are_ignored_and_counted(store: Store) -> None:
    _add(
        store, "i", [{"type": "accepted", "occurred_at": T0 + 10}], action="edit", received=T0 + 10
    )
    store.ingest(  # rejected: received 901 s after the interaction, past its 900 s window
        [parse_event({"event_id": "i-late", "interaction_id": "i", "type": "rejected",
                      "occurred_at": T0 + 901})], now=T0 + 901)  # fmt: skip
    rep = finalize(store, SPEC, now=CLOSED)
    assert rep.late_events == 1 and store.rewards("v1")["i"]["reward"] == 0.5


# (occurred_at the client claims, received_at on the server's clock): each must not count
CLIENT_TIME_LIES = {
    "a week late, backdated into the window": (T0 + 10, T0 + 7 * 86400),
    "an hour late, backdated": (T0 + 1, T0 + 3600),
    "dated before the interaction": (T0 - 60, T0 + 30),
    "dated a day before the interaction": (T0 - 86400, T0 + 30),
    "dated after it was received": (T0 + 500, T0 + 30),
    "received a minute before the interaction existed": (T0 - 60, T0 - 60),
}


@pytest.mark.parametrize("lie", sorted(CLIENT_TIME_LIES))
def test_join_windows_are_bound_by_the_servers_clocks(store: Store, lie: str) -> None:
    """The client's ``occurred_at`` cannot move feedback into a window (issue 47, class 5): a
    late acceptance backdated, feedback dated before the interaction it rates or after the
    server got it. Only the server's clocks place an event."""
    occurred, received = CLIENT_TIME_LIES[lie]
    _add(store, "i", [{"type": "rejected", "occurred_at": T0 + 5}], action="edit", received=T0 + 5)
    store.ingest([parse_event({"event_id": "lie", "interaction_id": "i", "type": "accepted",
                               "occurred_at": occurred})], now=received)  # fmt: skip
    rep = finalize(store, SPEC, now=max(CLOSED, received + 1))
    assert store.rewards("v1")["i"]["reward"] == -0.5, lie  # the rejection alone
    assert rep.late_events == 1


def test_honest_events_within_the_windows_and_the_clock_skew_count(store: Store) -> None:
    _add(store, "i", [{"type": "accepted", "occurred_at": T0 - 2}], action="edit", received=T0 + 1)
    finalize(store, SPEC, now=CLOSED)
    assert store.rewards("v1")["i"]["reward"] == 0.5  # 2 s of client clock skew is tolerated


def test_an_episode_id_names_an_episode_within_its_population_only(store: Store) -> None:
    """Two populations sending the same ``episode_id`` are two episodes: one's broken call,
    deferral or acceptance never scores the other's turns."""
    _add(store, "a-edit", [{"type": "accepted"}], action="edit", episode_id="ep", population="a")
    _add(store, "b-broken", [], action="none", tool_call_status="invalid", episode_id="ep",
         population="b", created_at=T0 + 1)  # fmt: skip
    _add(store, "c-defer", [], action="clarify", episode_id="ep", population="c",
         created_at=T0 + 2)  # fmt: skip
    _add(store, "d-edit", [], action="edit", episode_id="ep", population="d", created_at=T0 + 3)
    finalize(store, SPEC, now=CLOSED)
    rw = store.rewards("v1")
    assert rw["a-edit"]["reward"] == 0.5  # not -2.5 from b's broken call
    assert rw["b-broken"]["reward"] == -2.5
    assert rw["c-defer"]["reward"] == pytest.approx(-2.1)  # a deferral, not a's accepted edit
    assert rw["d-edit"]["status"] == "censored"  # no outcome of its own; a's does not count


def test_every_turn_shares_the_episode_outcome(store: Store) -> None:
    _add(store, "t1", [], action="tool", episode_id="ep")
    _add(store, "summary", [], action="none", episode_id="ep", is_summary=True, created_at=T0 + 1)
    _add(
        store,
        "t3",
        [{"type": "rejected"}],
        action="edit",
        episode_id="ep",
        created_at=T0 + 2,
        received=T0 + 2,
    )
    finalize(store, SPEC, now=CLOSED)
    rw = store.rewards("v1")
    assert [rw[i]["reward"] for i in ("t1", "summary", "t3")] == [-0.5, -0.5, -0.5]


def test_deferral_never_scores_above_the_edit() -> None:
    """Over every combination of outcomes an edit can receive, the deferral reward is <= it."""
    defer = score_episode(SPEC, [_turn("q", action="clarify")], {}, CLOSED)
    assert defer.kind == "deferral" and defer.reward == pytest.approx(-2.1)
    outcomes = [
        [{"type": "accepted", "payload": {}}, {"type": "rejected", "payload": {}}],
        [{"type": "edit_persisted", "payload": {"fraction": f}} for f in (0.0, 0.5, 1.0)],
        [
            {"type": "follow_up", "payload": {"sentiment": s}}
            for s in ("dissatisfied", "neutral", "satisfied")
        ],
        [{"type": "latency_ms", "payload": {"value": v}} for v in (0.0, 1e9)],
    ]
    for combo in itertools.product(*[[None, *o] for o in outcomes]):
        evs = [dict(e, occurred_at=T0, received_at=T0) for e in combo if e is not None]
        s = score_episode(SPEC, [_turn("e", action="edit")], {"e": evs}, CLOSED)
        if s.status == "scored":
            assert defer.reward <= s.reward + 1e-9


def test_spec_rejects_a_deferral_reward_above_the_worst_edit() -> None:
    with pytest.raises(ValidationError, match="could then score above making the edit"):
        RewardSpec(deferral=-1.0)
    with pytest.raises(ValidationError, match="broken_tool_call"):
        RewardSpec(broken_tool_call=-2.1)
    with pytest.raises(ValidationError, match="missing \\['tool_error'\\]"):
        RewardSpec(
            windows_s={
                k: 1.0
                for k in ("accepted", "rejected", "edit_persisted", "follow_up", "latency_ms")
            }
        )


def test_rewards_are_recomputable_and_versioned(store: Store) -> None:
    _add(store, "i", [{"type": "accepted"}], action="edit")
    finalize(store, SPEC, now=CLOSED)
    v2 = RewardSpec(version="v2", accept=1.0, broken_tool_call=-3.0)
    finalize(store, v2, now=CLOSED)
    assert store.rewards("v1")["i"]["reward"] == 0.5 and store.rewards("v2")["i"]["reward"] == 1.0
    before = store.rewards("v1")["i"]
    finalize(store, SPEC, now=CLOSED + 1, recompute=True)
    after = store.rewards("v1")["i"]
    assert after["reward"] == before["reward"] and after["computed_at"] == CLOSED + 1


@pytest.mark.parametrize("name", ["grpo", "rloo", "dr-grpo"])
def test_group_normalised_advantages_are_rejected_with_explanation(name: str) -> None:
    with pytest.raises(ValueError, match="one sample per context.*every advantage would be 0"):
        check_baseline(name)
    with pytest.raises(ValueError, match="valid: \\['batch-norm', 'running-segment'\\]"):
        check_baseline("value-head")


def test_batch_norm_baseline_hand_worked() -> None:
    # rewards [1, -1, 1, -1]: mean 0, population std 1 -> advantages equal the rewards
    a, state = advantages("batch-norm", torch.tensor([1.0, -1.0, 1.0, -1.0]), ["x"] * 4, {})
    assert torch.allclose(a, torch.tensor([1.0, -1.0, 1.0, -1.0]), atol=1e-5)
    assert state == {}


def test_running_segment_baseline_hand_worked() -> None:
    # first batch: unseen segments -> advantage 0; state a: 1.0 then 0.5*1 + 0.5*0 = 0.5
    before: dict[str, tuple[float, int]] = {}
    a1, s1 = advantages(
        "running-segment", torch.tensor([1.0, 0.0, 2.0]), ["a", "a", "b"], before, alpha=0.5
    )
    assert a1.tolist() == [0.0, 0.0, 0.0]
    assert s1 == {"a": (0.5, 2), "b": (2.0, 1)} and before == {}  # pure: input not modified
    a2, s2 = advantages("running-segment", torch.tensor([1.0, 1.0]), ["a", "b"], s1, alpha=0.5)
    assert a2.tolist() == [0.5, -1.0]  # 1 - 0.5, 1 - 2
    assert s2 == {"a": (0.75, 3), "b": (1.5, 2)}
