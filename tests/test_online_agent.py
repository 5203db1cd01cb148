"""Multi-turn agent traffic: the harness on the client side, ``coderl serve`` generating every
turn (summaries included), and the episode's outcome shared by all its turns once its windows
close. A scripted policy serves, so each episode's turns are known."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from test_agent_tools import PLAIN_CHATML

from coderl.agent.episode import EpisodeConfig
from coderl.agent.parsing import CALL_FORMATS
from coderl.agent.scripted import ScriptedPolicy
from coderl.config.online import SimulateConfig
from coderl.endpoint.http import BackgroundServer
from coderl.online.rewards import RewardSpec, finalize
from coderl.online.server import InteractionServer
from coderl.online.simulate import SimulatedPopulation
from coderl.online.store import Store, interaction_row
from coderl.online.suites import SuiteTask
from coderl.policy.tiny import tiny_tokenizer

call = CALL_FORMATS["xml"].format_call
TASK = SuiteTask(
    "toy/add",
    'def add(a, b):\n    """Return a + b."""\n',
    "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n",
    "add",
    "    return a + b\n",
)
SOLVED = TASK.prompt + "    return a + b\n"
BIG = "python3 -c \"print('ab ' * 600)\""  # ~1800 characters: the next turn cannot fit
WINDOW_S = 30.0
SPEC = RewardSpec(version="agent", windows_s=dict.fromkeys(RewardSpec().windows_s, WINDOW_S))


@pytest.fixture
def tok():
    t = tiny_tokenizer()
    t.chat_template = PLAIN_CHATML  # no tool support: the system prompt carries the format
    return t


def _script(cfg: EpisodeConfig, replies: list[str]):
    actions = iter(
        [
            call("read_file", {"path": "solution.py"}),
            call("run", {"command": BIG}),
            call("write_file", {"path": "solution.py", "content": SOLVED}),
            call("submit", {}),
        ]
    )

    def script(prompt: str) -> str:
        asked = (
            cfg.summary_instruction + "<|im_end|>" in prompt[-len(cfg.summary_instruction) - 50 :]
        )
        replies.append("Summary: read solution.py, ran a command." if asked else next(actions))
        return replies[-1]

    return script


def test_an_episodes_turns_and_its_summary_share_its_reward_once_its_windows_close(
    tok, tmp_path: Path
) -> None:
    cfg = EpisodeConfig(
        call_format="xml", template_tools=False, max_tokens_per_turn=100, summary_max_tokens=60,
        context_budget=1,  # set below, from the length of the first window
    )  # fmt: skip
    replies: list[str] = []
    policy = ScriptedPolicy(tok, _script(cfg, replies))
    store = Store(f"sqlite:///{tmp_path / 'online.db'}")
    server = InteractionServer(policy, store, version=0, call_format="xml", template_tools=False)
    from coderl.agent.context import ChatRenderer
    from coderl.agent.tools import TOOLSETS, resolve_tools

    renderer = ChatRenderer(tok, resolve_tools(TOOLSETS["function"]), CALL_FORMATS["xml"],
                            cfg.instructions, template_tools=False)  # fmt: skip
    first = tok.apply_chat_template(
        renderer.opening(TASK.task.problem_statement), tokenize=False, add_generation_prompt=True
    )
    # room for the opening window and a few small turns, not for the big command's output
    cfg.context_budget = len(tok.encode(first, add_special_tokens=False)) + 450
    bg = BackgroundServer(server.app())
    try:
        sim_cfg = SimulateConfig(agent=True, drop_rate=0, duplicate_rate=0, malformed_rate=0)
        sim = SimulatedPopulation(
            bg.base_url, sim_cfg, tasks=[TASK], sandbox="bwrap", tokenizer=tok, episode=cfg
        )
        stats = sim.run(1)
    finally:
        bg.stop()
    assert stats.episodes == 1 and stats.summaries == 1 and stats.passed == 1
    rows = sorted(store.interactions(), key=lambda r: r["created_at"])
    # read, run, summary, write, submit: five served turns of one episode
    assert len(rows) == stats.requests == 5 == len(replies)
    assert len({r["episode_id"] for r in rows}) == 1
    assert [r["is_summary"] for r in rows] == [False, False, True, False, False]
    assert {r["population"] for r in rows} <= {"org-0", "org-1"}
    assert [r["response_text"] for r in rows] == replies  # what the harness parsed, turn by turn

    last = rows[-1]["created_at"]
    early = finalize(store, SPEC, now=last + WINDOW_S / 2)  # the windows are still open
    assert early.pending == 5 and early.scored == 0 and not store.unclaimed_scored("agent")
    rep = finalize(store, SPEC, now=last + WINDOW_S + 1)
    assert rep.scored == 5 and rep.by_kind == {"edit": 5}
    rewards = store.rewards("agent")
    values = {rewards[r["interaction_id"]]["reward"] for r in rows}
    # accepted (+0.5) + persisted (+1.0) + satisfied (+0.5) - a small latency term
    assert len(values) == 1 and 1.9 < values.pop() <= 2.0
    assert len(store.unclaimed_scored("agent")) == 5  # every turn is trainable now


def test_a_turn_after_its_episode_was_scored_is_censored_and_the_rest_stay(tmp_path: Path) -> None:
    store = Store(f"sqlite:///{tmp_path / 'r.db'}")
    t0 = time.time()

    def turn(iid: str, at: float, **kw) -> dict:
        return interaction_row(iid, policy_version=0, created_at=at, prompt_token_ids=[1],
                               completion_token_ids=[2], behaviour_logprobs=[-0.1],
                               temperature=1.0, episode_id="ep", **kw)  # fmt: skip

    store.record_interaction(turn("a", t0, action="edit"))
    store.record_interaction(turn("b", t0 + 1, action="clarify"))
    from coderl.online.events import parse_event

    store.ingest([parse_event({"event_id": "e1", "interaction_id": "b", "type": "accepted",
                               "occurred_at": t0 + 2})], now=t0 + 2)  # fmt: skip
    finalize(store, SPEC, now=t0 + WINDOW_S + 5)
    before = store.rewards("agent")
    assert before["a"]["reward"] == before["b"]["reward"] == 0.5
    store.record_interaction(turn("c", t0 + WINDOW_S + 10, action="edit"))
    rep = finalize(store, SPEC, now=t0 + 3 * WINDOW_S)
    after = store.rewards("agent")
    assert rep.late_turns == 1 and after["c"]["status"] == "censored"
    assert after["c"]["terms"]["kind"] == "late_turn"
    assert after["a"] == before["a"] and after["b"] == before["b"]
    assert finalize(store, SPEC, now=t0 + 3 * WINDOW_S, recompute=True).late_turns == 0


def test_a_code_block_in_chat_is_graded_as_the_edit_the_server_recorded(tok, tmp_path: Path):
    # no tool call, the code pasted in a fenced block: the server classifies the turn as an edit,
    # so the simulated user grades that code; otherwise the episode would score an edit without
    # outcome (above the deferral reward) for code nobody looked at
    replies = iter([f"```python\n{SOLVED}```", call("submit", {})])
    policy = ScriptedPolicy(tok, lambda prompt: next(replies))
    store = Store(f"sqlite:///{tmp_path / 'online.db'}")
    server = InteractionServer(policy, store, version=0, call_format="xml", template_tools=False)
    cfg = EpisodeConfig(call_format="xml", template_tools=False, max_tokens_per_turn=100,
                        context_budget=3000)  # fmt: skip
    bg = BackgroundServer(server.app())
    try:
        sim_cfg = SimulateConfig(agent=True, drop_rate=0, duplicate_rate=0, malformed_rate=0)
        sim = SimulatedPopulation(
            bg.base_url, sim_cfg, tasks=[TASK], sandbox="bwrap", tokenizer=tok, episode=cfg
        )
        stats = sim.run(1)
    finally:
        bg.stop()
    assert stats.edits == stats.passed == 1 and stats.requests == 2
    rows = store.interactions()
    assert sorted(r["action"] for r in rows) == ["edit", "tool"]
    finalize(store, SPEC, now=max(r["created_at"] for r in rows) + WINDOW_S + 1)
    values = {v["reward"] for v in store.rewards("agent").values()}
    assert len(values) == 1 and values.pop() > 1.9  # accepted, persisted, satisfied
