"""``coderl serve`` with the official ``openai`` client against localhost, on tiny-random."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from openai import OpenAI

from coderl.online.server import BackgroundServer, InteractionServer, parse_tool_calls
from coderl.online.store import Store
from coderl.policy import load_policy


class _Resp:
    def __init__(self, status: int, body: bytes) -> None:
        self.status_code, self._body = status, body

    def json(self):
        return json.loads(self._body)


def _http(url: str, *, json_body=None, content: bytes | None = None, method: str = "POST"):
    data = (
        content
        if content is not None
        else (None if json_body is None else json.dumps(json_body).encode())
    )
    req = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req) as r:
            return _Resp(r.status, r.read())
    except urllib.error.HTTPError as e:
        return _Resp(e.code, e.read())


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "description": "write a file",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                "required": ["path", "content"],
            },
        },
    }
]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # a 1M-parameter model gains nothing from intra-op threads; on busy cores they cost ~5x
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    store = Store(f"sqlite:///{tmp_path_factory.mktemp('serve') / 'online.db'}")
    policy = load_policy("tiny-random", reference=False)
    srv = InteractionServer(policy, store, version=3, model_name="tiny", max_new_tokens=12)
    bg = BackgroundServer(srv.app())
    yield store, policy, bg
    bg.stop()


def test_openai_client_round_trip_records_exact_tokens_and_logprobs(served) -> None:
    store, policy, bg = served
    client = OpenAI(base_url=bg.base_url, api_key="unused")
    r = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "fix the bug"}],
        tools=TOOLS,
        logprobs=True,
        seed=7,
        extra_body={"episode_id": "ep-1", "population": "org-a"},
    )
    assert r.id.startswith("chatcmpl-") and r.model_extra["interaction_id"] == r.id
    [row] = store.interactions(ids=[r.id])
    assert row["policy_version"] == 3 and row["episode_id"] == "ep-1"
    assert row["population"] == "org-a"
    assert row["temperature"] == 0.8  # stochastic by default
    lps = [c.logprob for c in r.choices[0].logprobs.content]
    assert lps == pytest.approx(row["behaviour_logprobs"])
    assert len(row["completion_token_ids"]) == r.usage.completion_tokens == len(lps)
    assert r.usage.prompt_tokens == len(row["prompt_token_ids"])
    # the recorded logprobs are the policy's own: recompute them with the trainer-side forward
    seq = row["prompt_token_ids"] + row["completion_token_ids"]
    [trainer] = policy.logprobs([seq], temperature=0.8)
    n = len(row["prompt_token_ids"])
    assert trainer[n:] == pytest.approx(row["behaviour_logprobs"], abs=1e-3)


def test_sampling_is_stochastic_and_seeded(served) -> None:
    _, _, bg = served
    client = OpenAI(base_url=bg.base_url, api_key="unused")
    msgs = [{"role": "user", "content": "hello"}]
    texts = {
        client.chat.completions.create(model="tiny", messages=msgs, seed=s, max_tokens=8)
        .choices[0]
        .message.content
        for s in range(4)
    }
    assert len(texts) > 1
    same = [
        client.chat.completions.create(model="tiny", messages=msgs, seed=11, max_tokens=8)
        .choices[0]
        .message.content
        for _ in range(2)
    ]
    assert same[0] == same[1]


def test_feedback_endpoint_is_idempotent_and_reports_malformed(served) -> None:
    store, _, bg = served
    ev = {
        "event_id": "fb-1",
        "interaction_id": "chatcmpl-x",
        "type": "follow_up",
        "sentiment": "satisfied",
    }
    url = bg.base_url + "/feedback"
    assert _http(url, json_body=ev).json() == {"stored": 1, "duplicates": 0, "rejected": []}
    assert _http(url, json_body=[ev]).json()["duplicates"] == 1
    bad = _http(url, content=b"{oops")
    assert bad.status_code == 400 and bad.json()["rejected"][0].startswith("invalid_json")
    mixed = _http(url, json_body={"events": [{**ev, "event_id": "fb-2"}, {"type": "accepted"}]})
    assert mixed.status_code == 400 and mixed.json()["stored"] == 1
    assert "event_id: Field required" in mixed.json()["rejected"][0]
    stats = _http(bg.base_url + "/stats", method="GET").json()
    assert stats["duplicate_events"] == 1
    assert stats["rejected_events"] == {"invalid_json": 1, "invalid_event": 1}


def test_bad_requests_get_clear_errors(served) -> None:
    _, _, bg = served
    url = bg.base_url + "/chat/completions"
    r = _http(url, json_body={"model": "tiny", "messages": [], "stream": False})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    r = _http(
        url,
        json_body={"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream": True},
    )
    assert r.status_code == 400 and "stream" in r.json()["error"]["message"]
    r = _http(
        url,
        json_body={
            "model": "tiny",
            "messages": [{"role": "user", "content": "x"}],
            "frequency_penalty": 1,
        },
    )
    assert r.status_code == 400 and "frequency_penalty" in r.json()["error"]["message"]


def test_tool_call_parsing_valid_and_invalid() -> None:
    call = {"name": "write_file", "arguments": {"path": "a.py", "content": "x"}}
    content, calls, status = parse_tool_calls(
        f"ok <tool_call>{json.dumps(call)}</tool_call>", TOOLS
    )
    assert status == "valid" and content == "ok"
    assert json.loads(calls[0]["function"]["arguments"]) == call["arguments"]
    for text in (
        "<tool_call>{not json</tool_call>",
        '<tool_call>{"name": "write_file"',
        '<tool_call>{"name": "rm", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "write_file", "arguments": {"path": "a"}}</tool_call>',
    ):
        content, calls, status = parse_tool_calls(text, TOOLS)
        assert (status, calls, content) == ("invalid", [], text)


def test_invalid_tool_call_is_served_as_text_and_stored_invalid(tmp_path: Path) -> None:
    class Broken:  # a scripted policy that writes a broken call
        tokenizer = load_policy("tiny-random", reference=False).tokenizer

        def generate(self, prompts, params):
            from coderl.policy.base import Completion

            ids = self.tokenizer.encode(
                '<tool_call>{"name": "write_file"', add_special_tokens=False
            )
            return [Completion(ids, [-0.5] * len(ids), "stop", 0)]

    store = Store(f"sqlite:///{tmp_path / 'b.db'}")
    srv = InteractionServer(Broken(), store, version=0)
    bg = BackgroundServer(srv.app())
    try:
        r = OpenAI(base_url=bg.base_url, api_key="x").chat.completions.create(
            model="m", messages=[{"role": "user", "content": "go"}], tools=TOOLS
        )
    finally:
        bg.stop()
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content.startswith("<tool_call>")
    [row] = store.interactions()
    assert (row["tool_call_status"], row["action"]) == ("invalid", "none")
