"""``coderl serve`` with the official ``openai`` client against localhost, on tiny-random."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
import torch
from openai import OpenAI

from coderl.agent.parsing import CALL_FORMATS
from coderl.agent.tools import TOOLS as HARNESS_TOOLS
from coderl.endpoint.calls import parse_reply, served_tools
from coderl.endpoint.http import BackgroundServer
from coderl.online.events import MAX_EVENT_BYTES, MAX_REQUEST_BYTES
from coderl.online.server import InteractionServer
from coderl.online.store import Store
from coderl.policy import load_policy


class _Resp:
    def __init__(self, status: int, body: bytes) -> None:
        self.status_code, self._body = status, body

    def json(self):
        return json.loads(self._body)

    @property
    def text(self) -> str:
        return self._body.decode()


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


TOOLS = [HARNESS_TOOLS["write_file"].schema]  # the harness's schema, as a client gets it


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


def test_an_unknown_model_name_is_a_not_found_error_as_vllm_answers_it(served) -> None:
    """The served name and the alias ``coderl`` are answered (the reply names the one asked
    for); any other name is a 404 ``NotFoundError``, nothing sampled or recorded."""
    import openai

    store, _, bg = served
    client = OpenAI(base_url=bg.base_url, api_key="unused", max_retries=0)
    before = len(store.interactions())
    msgs = [{"role": "user", "content": "fix the bug"}]
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-4o", messages=msgs, max_tokens=2)
    assert "The model `gpt-4o` does not exist (served: tiny, coderl)" in str(err.value)
    assert err.value.body["type"] == "NotFoundError"
    assert len(store.interactions()) == before
    for name in ("tiny", "coderl"):
        r = client.chat.completions.create(model=name, messages=msgs, max_tokens=2)
        assert r.model == name
    assert [m.id for m in client.models.list()] == ["tiny", "coderl"]


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
    assert "event_id: missing" in mixed.json()["rejected"][0]
    stats = _http(bg.base_url + "/stats", method="GET").json()
    assert stats["duplicate_events"] == 1
    assert stats["rejected_events"] == {"invalid_json": 1, "invalid_event": 1}


def test_bad_requests_get_clear_errors(served) -> None:
    _, _, bg = served
    url = bg.base_url + "/chat/completions"
    r = _http(url, json_body={"model": "tiny", "messages": [], "stream": False})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    user = [{"role": "user", "content": "x"}]
    r = _http(url, json_body={"model": "tiny", "messages": user, "frequency_penalty": 1})
    msg = r.json()["error"]["message"]
    assert (
        r.status_code == 400
        and msg == "frequency_penalty: 1 is not supported; supported: 0 (no penalty)"
    )
    r = _http(url, json_body={"model": "tiny", "messages": user, "guided_json": {}})
    msg = r.json()["error"]["message"]
    assert r.status_code == 400 and msg.startswith("guided_json: unknown field")
    assert "accepted fields:" in msg and "stop" in msg and "tool_choice" in msg
    refused = {
        "tool_choice": ({"tool_choice": "required"}, "supported: 'auto', 'none'"),
        "image part": (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "'image_url' is not supported",
        ),
        "response_format": (
            {"response_format": {"type": "json_object"}},
            'not supported; supported: {"type": "text"}',
        ),
    }
    for what, (extra, says) in refused.items():
        r = _http(url, json_body={"model": "tiny", "messages": user} | extra)
        assert r.status_code == 400 and says in r.json()["error"]["message"], what
    r = _http(url, json_body={"model": "gpt-4o", "messages": user, "max_tokens": 2})
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"  # as vLLM


def test_tool_call_parsing_valid_and_invalid() -> None:
    tools = served_tools(TOOLS)
    call = {"name": "write_file", "arguments": {"path": "a.py", "content": "x"}}
    content, calls, status = parse_reply(
        f"ok <tool_call>{json.dumps(call)}</tool_call>", tools, "hermes"
    )
    assert status == "valid" and content == "ok"
    assert json.loads(calls[0]["function"]["arguments"]) == call["arguments"]
    for text in (
        "<tool_call>{not json</tool_call>",
        '<tool_call>{"name": "write_file"',
        '<tool_call>{"name": "rm", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "write_file", "arguments": {"path": "a"}}</tool_call>',
        # stricter than a schema check: the harness refuses unknown and wrongly typed arguments
        '<tool_call>{"name": "write_file", "arguments": {"path": "a", "content": "x", "mode": 1}}'
        "</tool_call>",
        '<tool_call>{"name": "write_file", "arguments": {"path": "a", "content": 3}}</tool_call>',
    ):
        content, calls, status = parse_reply(text, tools, "hermes")
        assert (status, calls, content) == ("invalid", [], text)


class Scripted:
    """A policy that always writes ``text`` (a model trained to write it)."""

    tokenizer = load_policy("tiny-random", reference=False).tokenizer

    def __init__(self, text: str) -> None:
        self.text, self.prompts = text, []

    def generate(self, prompts, params):
        from coderl.policy.base import Completion

        self.prompts += prompts
        ids = self.tokenizer.encode(self.text, add_special_tokens=False)
        ids.append(self.tokenizer.convert_tokens_to_ids("<|im_end|>"))  # the turn's end
        return [Completion(ids, [-0.5] * len(ids), "stop", 0)]


def _serve_once(tmp_path: Path, text: str, call_format: str, tools=TOOLS, **kw):
    store = Store(f"sqlite:///{tmp_path / f'{uuid.uuid4().hex}.db'}")
    policy = Scripted(text)
    srv = InteractionServer(policy, store, version=0, call_format=call_format, **kw)
    bg = BackgroundServer(srv.app())
    try:
        r = OpenAI(base_url=bg.base_url, api_key="x").chat.completions.create(
            model="coderl",
            messages=[
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "go"},
            ],
            tools=tools,
        )
    finally:
        bg.stop()
    [row] = store.interactions()
    return r, row, policy


XML_CALL = CALL_FORMATS["xml"].format_call(
    "write_file", {"path": "solution.py", "content": 'def f(x):\n    return "{x}"\n'}
)


def test_a_model_trained_in_xml_is_served_in_xml_and_its_call_is_valid(tmp_path: Path) -> None:
    r, row, policy = _serve_once(tmp_path, XML_CALL, "xml", template_tools=False)
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "write_file"
    assert json.loads(call.function.arguments) == {
        "path": "solution.py",
        "content": 'def f(x):\n    return "{x}"\n',
    }
    assert r.choices[0].finish_reason == "tool_calls"
    assert (row["tool_call_status"], row["action"]) == ("valid", "edit")
    # the model was shown the tools as in training: the xml format's section in the system prompt
    prompt = policy.tokenizer.decode(policy.prompts[0])
    assert "Be brief." in prompt and "<function=<tool name>>" in prompt and "write_file" in prompt
    # served in another format than the model writes, the same reply is a broken call
    _, row, _ = _serve_once(tmp_path, XML_CALL, "hermes")
    assert row["tool_call_status"] == "invalid"


def test_hermes_calls_are_valid_in_the_hermes_format(tmp_path: Path) -> None:
    text = CALL_FORMATS["hermes"].format_call("write_file", {"path": "a.py", "content": "x = 1"})
    r, row, _ = _serve_once(tmp_path, "Here it is.\n" + text, "hermes")
    assert r.choices[0].message.content == "Here it is."
    assert json.loads(r.choices[0].message.tool_calls[0].function.arguments)["content"] == "x = 1"
    assert row["tool_call_status"] == "valid"


def test_a_call_the_harness_would_not_run_is_recorded_broken(tmp_path: Path) -> None:
    bad = CALL_FORMATS["xml"].format_call("write_file", {"path": "a.py"})  # no content
    r, row, _ = _serve_once(tmp_path, bad, "xml", template_tools=False)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content == bad
    assert (row["tool_call_status"], row["action"]) == ("invalid", "none")
    # a call of a tool the request did not offer is broken too
    _, row, _ = _serve_once(tmp_path, XML_CALL, "xml", tools=[HARNESS_TOOLS["submit"].schema])
    assert row["tool_call_status"] == "invalid"


def test_tools_must_be_the_harness_tools(served) -> None:
    _, _, bg = served
    url = bg.base_url + "/chat/completions"
    msgs = [{"role": "user", "content": "x"}]
    other = {"type": "function", "function": {"name": "rm_rf", "parameters": {}}}
    r = _http(url, json_body={"model": "tiny", "messages": msgs, "tools": [other]})
    assert r.status_code == 400 and "unknown tool 'rm_rf'" in r.json()["error"]["message"]
    changed = json.loads(json.dumps(TOOLS[0]))
    changed["function"]["parameters"]["required"] = ["path"]
    r = _http(url, json_body={"model": "tiny", "messages": msgs, "tools": [changed]})
    assert (
        r.status_code == 400 and "differ from the harness's schema" in r.json()["error"]["message"]
    )
    listed = _http(bg.base_url + "/tools", method="GET").json()
    assert {t["function"]["name"] for t in listed["data"]} == set(HARNESS_TOOLS)


def test_feedback_endpoint_holds_every_event_to_the_import_limits(served) -> None:
    store, _, bg = served
    url = bg.base_url + "/feedback"
    before = store.rejected_counts()
    # deeply nested JSON: a clear 400, not a server error
    r = _http(url, content=b"[" * 100_000 + b"]" * 100_000)
    assert r.status_code == 400 and r.json()["rejected"][0].startswith("too_deep: nested deeper")
    ev = {"event_id": "lim-1", "interaction_id": "chatcmpl-x", "type": "tool_error"}
    r = _http(url, json_body={"events": [{**ev, "message": [[[[[[[[["x"]]]]]]]]]}]})
    assert r.status_code == 400 and r.json()["rejected"][0].startswith("too_deep")
    # the per-event size limit of imports applies to posted events too
    r = _http(url, json_body=[{**ev, "message": "x" * (MAX_EVENT_BYTES + 1)}])
    assert r.status_code == 400 and r.json()["rejected"][0].startswith("too_large")
    r = _http(url, content=b" " * (MAX_REQUEST_BYTES + 1))
    assert r.status_code == 413 and r.json()["rejected"][0].startswith("too_large")
    # non-finite numbers and booleans are not numbers
    lat = {**ev, "type": "latency_ms", "event_id": "lim-2"}
    overflow = json.dumps({**lat, "value": 5, "occurred_at": 1}).replace('": 1}', '": 1e999}')
    r = _http(url, content=overflow.encode())  # a JSON number that parses to inf
    assert r.status_code == 400 and "occurred_at: must be a finite number" in r.text
    r = _http(
        url,
        content=b'{"event_id": "lim-3", "interaction_id": "i", "type": "latency_ms", "value": NaN}',
    )
    assert r.status_code == 400 and "NaN is not a JSON number" in r.text
    persisted = {**ev, "type": "edit_persisted", "event_id": "lim-4", "after_minutes": 5}
    r = _http(url, json_body={**persisted, "fraction": True})
    assert r.status_code == 400 and "expected a number, got the boolean true" in r.text
    assert _http(url, json_body={**persisted, "fraction": 1}).status_code == 200  # ints are fine
    after = store.rejected_counts()
    assert sum(after.values()) - sum(before.values()) == 7  # every refusal is counted


@pytest.mark.parametrize("call_format", ["xml", "hermes"])
def test_a_malformed_earlier_tool_call_is_the_clients_400(tmp_path: Path, call_format) -> None:
    """Arguments that are not a JSON object, or nested past the decoder's limit, are the
    client's bad input (400, named), never a server error: the endpoint's catch of template
    errors is narrow, so the tool-call reader names these itself."""
    srv = InteractionServer(Scripted("Done."), Store(f"sqlite:///{tmp_path / 't.db'}"), version=0,
                            call_format=call_format, template_tools=False)  # fmt: skip
    bg = BackgroundServer(srv.app())
    try:
        for arguments in ("5", "[" * 5000 + "]" * 5000):
            call = {"id": "c", "type": "function",
                    "function": {"name": "write_file", "arguments": arguments}}  # fmt: skip
            messages = [
                {"role": "user", "content": "write it"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c", "content": "ok"},
            ]
            body = {"model": "coderl", "messages": messages}
            r = _http(bg.base_url + "/chat/completions", json_body=body)
            assert r.status_code == 400 and "malformed tool call" in r.text, r.text
    finally:
        bg.stop()


def test_earlier_tool_calls_are_rendered_back_in_the_served_format(tmp_path: Path) -> None:
    """An OpenAI client sends the previous turn back as ``tool_calls`` + a tool message; the
    model sees that turn as it wrote it, in its call format."""
    store = Store(f"sqlite:///{tmp_path / 'turns.db'}")
    policy = Scripted("Done.")
    srv = InteractionServer(policy, store, version=0, call_format="xml", template_tools=False)
    bg = BackgroundServer(srv.app())
    args = {"path": "solution.py", "content": "x = 1\n"}
    try:
        r = OpenAI(base_url=bg.base_url, api_key="x").chat.completions.create(
            model="coderl",
            tools=TOOLS,
            messages=[
                {"role": "user", "content": "write it"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "write_file", "arguments": json.dumps(args)},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "Wrote 1 lines."},
            ],
        )
    finally:
        bg.stop()
    assert r.choices[0].message.content == "Done." and not r.choices[0].message.tool_calls
    prompt = policy.tokenizer.decode(policy.prompts[0])
    assert CALL_FORMATS["xml"].format_call("write_file", args) in prompt
    assert "Wrote 1 lines." in prompt
    [row] = store.interactions()
    assert row["tool_call_status"] == "none"


def test_every_request_records_its_sampling_settings_adapter_and_token_ids(served) -> None:
    store, policy, bg = served
    client = OpenAI(base_url=bg.base_url, api_key="unused")

    def ask(**kw):
        r = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "fix it"}], logprobs=True, **kw
        )
        [row] = store.interactions(ids=[r.id])
        return r, row

    r, row = ask(temperature=1.3, top_p=0.9, max_tokens=5, seed=21,
                 extra_body={"return_token_ids": True})  # fmt: skip
    assert (row["temperature"], row["top_p"], row["seed"]) == (1.3, 0.9, 21)
    assert row["max_new_tokens"] == 5 and len(row["completion_token_ids"]) <= 5
    assert row["adapter"] == "shared@v3" and row["policy_version"] == 3
    assert r.choices[0].model_extra["token_ids"] == row["completion_token_ids"]
    assert r.model_extra["prompt_token_ids"] == row["prompt_token_ids"]
    # the server's cap bounds a larger request; without return_token_ids none come back
    r, row = ask(max_tokens=500)
    assert row["max_new_tokens"] == 12 and "token_ids" not in (r.choices[0].model_extra or {})
    assert row["temperature"] == 0.8 and row["top_p"] == 1.0 and row["seed"] is None


def test_a_promotion_is_picked_up_without_a_restart(tmp_path: Path) -> None:
    store = Store(f"sqlite:///{tmp_path / 'online.db'}")
    first = load_policy("tiny-random", reference=False, seed=0)
    second = load_policy("tiny-random", reference=False, seed=1)
    with torch.no_grad():
        for p in second.model.parameters():
            p.add_(torch.randn_like(p), alpha=0.5)
    champion = {"version": 1}

    def reload(current: int):
        v = champion["version"]
        return None if v == current else (second, v)

    srv = InteractionServer(first, store, version=1, max_new_tokens=6, reload=reload)
    bg = BackgroundServer(srv.app())
    try:
        client = OpenAI(base_url=bg.base_url, api_key="unused")
        msgs = [{"role": "user", "content": "hello"}]
        a = client.chat.completions.create(model="coderl", messages=msgs, seed=3, logprobs=True)
        assert _http(bg.base_url + "/admin/reload").json()["policy_version"] == 1  # unchanged
        champion["version"] = 2  # the registry promoted a candidate
        assert _http(bg.base_url + "/admin/reload").json()["policy_version"] == 2
        b = client.chat.completions.create(model="coderl", messages=msgs, seed=3, logprobs=True)
    finally:
        bg.stop()
    ra, rb = (store.interactions(ids=[x.id])[0] for x in (a, b))
    assert (ra["policy_version"], ra["adapter"]) == (1, "shared@v1")
    assert (rb["policy_version"], rb["adapter"]) == (2, "shared@v2")
    # the reply names the model asked for (as vLLM answers); the version is in its extra fields
    assert (b.model, b.model_extra["policy_version"], b.model_extra["adapter"]) == (
        "coderl",
        2,
        "shared@v2",
    )
    assert b.system_fingerprint == "coderl-v2"
    # the new weights sampled it: their own forward reproduces the recorded logprobs
    seq = rb["prompt_token_ids"] + rb["completion_token_ids"]
    n = len(rb["prompt_token_ids"])
    [lp] = second.logprobs([seq], temperature=0.8)
    assert lp[n:] == pytest.approx(rb["behaviour_logprobs"], abs=1e-3)
    [old] = first.logprobs([seq], temperature=0.8)
    assert old[n:] != pytest.approx(rb["behaviour_logprobs"], abs=1e-3)


# --- what agent frameworks send (issue 48 #6): content parts, stop, streaming, tool_choice ----


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory):
    """A server whose policy always answers ``abc STOP def`` (token-exact, logprobs 0)."""
    from coderl.agent.scripted import ScriptedPolicy

    tok = load_policy("tiny-random", reference=False).tokenizer
    policy = ScriptedPolicy(tok, lambda _: "abc STOP def")
    store = Store(f"sqlite:///{tmp_path_factory.mktemp('scripted') / 'o.db'}")
    srv = InteractionServer(policy, store, version=0, model_name="tiny", max_new_tokens=64)
    bg = BackgroundServer(srv.app())
    yield store, policy, OpenAI(base_url=bg.base_url, api_key="unused")
    bg.stop()


def _row(store: Store, iid: str) -> dict:
    [row] = store.interactions(ids=[iid])
    return row


def test_content_as_a_list_of_text_parts_is_the_same_prompt(scripted) -> None:
    store, _, client = scripted
    parts = [{"type": "text", "text": "fix "}, {"type": "text", "text": "the bug"}]
    a = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": parts}])
    b = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "fix the bug"}]
    )
    assert _row(store, a.id)["prompt_token_ids"] == _row(store, b.id)["prompt_token_ids"]


def test_stop_cuts_the_reply_and_the_recording_at_the_same_token(scripted) -> None:
    store, policy, client = scripted
    msgs = [{"role": "user", "content": "go"}]
    full = client.chat.completions.create(model="tiny", messages=msgs)
    cut = client.chat.completions.create(model="tiny", messages=msgs, stop=["STOP", "zzz"])
    assert full.choices[0].message.content == "abc STOP def"
    assert cut.choices[0].message.content == "abc " and cut.choices[0].finish_reason == "stop"
    whole, part = _row(store, full.id), _row(store, cut.id)
    k = len(part["completion_token_ids"])
    assert 0 < k < len(whole["completion_token_ids"])
    assert part["completion_token_ids"] == whole["completion_token_ids"][:k]  # a prefix, exact
    assert "STOP" in policy.tokenizer.decode(part["completion_token_ids"])
    assert "STOP" not in policy.tokenizer.decode(part["completion_token_ids"][:-1])
    with pytest.raises(Exception, match="at most 4"):
        client.chat.completions.create(model="tiny", messages=msgs, stop=["a", "b", "c", "d", "e"])


def test_a_stream_carries_the_same_reply_and_is_recorded_alike(scripted) -> None:
    store, _, client = scripted
    msgs = [{"role": "user", "content": "stream it"}]
    plain = client.chat.completions.create(model="tiny", messages=msgs)
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=msgs, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    a, b = _row(store, plain.id), _row(store, chunks[0].id)
    assert a["prompt_token_ids"] == b["prompt_token_ids"]
    assert a["completion_token_ids"] == b["completion_token_ids"]


def test_tool_choice_none_hides_the_tools_and_parses_no_call(served) -> None:
    store, _, bg = served
    client = OpenAI(base_url=bg.base_url, api_key="unused")
    msgs = [{"role": "user", "content": "fix the bug"}]
    kw = {"model": "tiny", "messages": msgs, "max_tokens": 2}
    auto = client.chat.completions.create(**kw, tools=TOOLS)
    none = client.chat.completions.create(**kw, tools=TOOLS, tool_choice="none")
    bare = client.chat.completions.create(**kw)
    rows = {r["interaction_id"]: r["prompt_token_ids"] for r in store.interactions()}
    assert rows[none.id] == rows[bare.id] != rows[auto.id]
    assert none.choices[0].message.tool_calls is None


def test_serve_checks_its_port_before_loading_the_model(capsys) -> None:
    import socket
    import time

    from coderl.cli import main

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t = time.perf_counter()
        code = main(
            ["serve", "configs/online-demo.yaml", "--host", "127.0.0.1", "--port", str(port)]
        )
        took = time.perf_counter() - t
    err = capsys.readouterr().err
    assert code == 2 and f"cannot listen on 127.0.0.1:{port}" in err and "--port" in err
    assert took < 5  # no model was loaded, no database opened


# --- errors and models as OpenAI's clients expect them (issue 48 class 6) ----------------------


def _error(r: _Resp, status: int) -> dict:
    """The body of an OpenAI-shaped error with HTTP ``status`` (every key present)."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    return err


def test_models_retrieve_answers_served_names_and_a_not_found_error_otherwise(served) -> None:
    import openai

    _, _, bg = served
    client = OpenAI(base_url=bg.base_url, api_key="unused", max_retries=0)
    for name in ("tiny", "coderl"):
        m = client.models.retrieve(name)
        assert (m.id, m.object, m.owned_by) == (name, "model", "coderl")
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("gpt-4o")
    body = err.value.body
    assert body["type"] == "NotFoundError" and body["param"] == "model" and body["code"] == 404
    assert "The model `gpt-4o` does not exist (served: tiny, coderl)" in body["message"]


def test_unknown_paths_wrong_methods_and_bad_fields_answer_openai_shaped_errors(served) -> None:
    import openai

    _, _, bg = served
    client = OpenAI(base_url=bg.base_url, api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as nf:
        client.completions.create(model="tiny", prompt="x")  # legacy endpoint: not served
    assert nf.value.body["message"] == "no such endpoint: POST /v1/completions"
    assert nf.value.body["type"] == "NotFoundError" and nf.value.body["param"] is None
    err = _error(_http(bg.base_url + "/models", method="DELETE"), 405)
    assert err["message"] == "method not allowed: DELETE /v1/models (allowed: GET)"
    assert err["type"] == "invalid_request_error"
    url = bg.base_url + "/chat/completions"
    user = [{"role": "user", "content": "x"}]
    err = _error(_http(url, json_body={"model": "tiny", "messages": user, "top_p": 7}), 400)
    assert err["param"] == "top_p" and err["message"].startswith("top_p: ")
    err = _error(_http(url, json_body={"model": "tiny", "messages": user, "stop": [""]}), 400)
    assert err["param"] == "stop"
    err = _error(_http(bg.base_url + "/admin/reload"), 404)  # an HTTPException of a route
    assert err["message"] == "reload is not configured"


def test_a_body_that_is_not_a_json_object_says_so(served) -> None:
    _, _, bg = served
    url = bg.base_url + "/chat/completions"
    err = _error(_http(url, content=b'{"model": "tiny", oops'), 400)
    assert err["message"].startswith("the request body is not valid JSON (Expecting ")
    assert err["param"] is None
    err = _error(_http(url, json_body=["tiny"]), 400)
    assert err["message"] == 'the request body must be a JSON object, not list ["tiny"]'


def test_only_openai_roles_are_accepted_and_developer_is_the_system_role(served) -> None:
    import openai

    store, _, bg = served
    client = OpenAI(base_url=bg.base_url, api_key="unused", max_retries=0)
    before = len(store.interactions())
    wizard = [{"role": "user", "content": "hi"}, {"role": "wizard", "content": "abracadabra"}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=wizard, max_tokens=2)
    assert err.value.body["param"] == "messages.1.role"
    assert err.value.body["message"] == (
        'messages.1.role: "wizard" is not a valid role; '
        "supported: system, developer, user, assistant, tool"
    )
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[{"content": "hi"}], max_tokens=2)
    assert len(store.interactions()) == before  # nothing sampled or recorded
    rows = []
    for role in ("developer", "system"):
        msgs = [{"role": role, "content": "Be brief."}, {"role": "user", "content": "hi"}]
        r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=2)
        rows.append(store.interactions(ids=[r.id])[0]["prompt_token_ids"])
    assert rows[0] == rows[1]  # developer is rendered exactly as system


def test_the_documented_feedback_examples_are_accepted_one_per_type() -> None:
    from coderl.config.online import EVENT_TYPES
    from coderl.online.events import Rejected, parse_event

    page = (Path(__file__).parents[1] / "docs" / "online.md").read_text()
    block = re.split(r"One example per\s+type", page)[1].split("```json\n")[1].split("```")[0]
    events = [json.loads(line) for line in block.splitlines()]
    parsed = [parse_event(e) for e in events]
    assert not [p for p in parsed if isinstance(p, Rejected)], parsed
    assert [e["type"] for e in events] == list(EVENT_TYPES)
