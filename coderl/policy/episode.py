"""Token-exact multi-turn trajectory assembly with the tokenizer's chat template.

:class:`EpisodeBuilder` keeps, for the current context window, the exact token ids the policy is
sampling from; the agent harness drives it:

```
ep = EpisodeBuilder(policy.tokenizer, messages, tools=tools)    # prompt rendered by the template
while not done:
    c = policy.generate([ep.prompt_ids()], params)[0]         # sample from exactly these ids
    ep.add_completion(c, message=parsed_assistant_message)    # sampled ids appended, trainable
    ep.add_observation([{"role": "tool", "content": out}])    # template delta, tokenized alone
trajectory = ep.trajectory
```

Why deltas: re-rendering the whole conversation and re-tokenizing it would re-tokenize the
model's sampled text, which need not give back the sampled ids (BPE merges across the boundary,
whitespace normalisation), and a template may rewrite history. Instead an observation is rendered
as the text the template puts *after* the assistant turn: the end-of-turn scaffolding the model
did not sample itself (the remainder of the template's closing after the sampled stop token, or
all of it when the completion hit its length budget), the observation turns and the next
generation prompt. That delta is tokenized on its own and appended with loss mask 0.

The delta is found by rendering the conversation with a placeholder as the last assistant turn's
content, with and without the new messages. If rendering the real history with the new messages
does not start with rendering the real history alone (the template rewrites earlier turns, e.g.
strips earlier reasoning), the builder starts a new segment from the full re-rendered
conversation instead of training on a prefix the model never saw.

Invariant (tested): for every trainable token, the segment's prefix equals the prompt it was
sampled from.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jinja2

from coderl.policy.base import Completion, check_finish_reason
from coderl.trajectory import Segment, Trajectory

PLACEHOLDER = "\u2063coderl-placeholder\u2063"


def supports_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders a ``tools`` argument.

    SmolLM2's template does not: the harness must describe its tools in the system prompt.
    """
    template = getattr(tokenizer, "chat_template", None) or ""
    return "tools" in template


def render(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    *,
    tools: Sequence[dict[str, Any]] | None = None,
    add_generation_prompt: bool,
) -> str:
    """Render ``messages`` (and ``tools``, when given) with the tokenizer's chat template.

    Raises:
        ValueError: the tokenizer has no chat template.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template; cannot render a conversation")
    kwargs: dict[str, Any] = {"tools": list(tools)} if tools else {}
    text = tokenizer.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
    )
    return str(text)


TEMPLATE_FAULTS: tuple[type[Exception], ...] = (jinja2.TemplateError, TypeError, ValueError)
"""What :func:`render` raises when the chat template rejects what it is given: the template's own
``raise_exception``, an undefined value or a syntax error (``jinja2.TemplateError``), a value of
a type or content its code cannot take (TypeError, ValueError), no chat template (ValueError)."""


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` on its own: no BOS/EOS added (the template writes its own)."""
    return list(tokenizer.encode(text, add_special_tokens=False))


class EpisodeBuilder:
    """Build a :class:`~coderl.trajectory.Trajectory` turn by turn (see the module docstring).

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        messages: the initial conversation (system, user, ...), as chat-template dicts.
        tools: tool definitions (JSON-schema dicts) passed to the template, or None.
        provenance: extra audit data copied into every segment's ``provenance``.
    """

    def __init__(
        self,
        tokenizer: Any,
        messages: Sequence[dict[str, Any]],
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        provenance: dict[str, Any] | None = None,
    ):
        if not messages:
            raise ValueError("an episode needs at least one initial message")
        self.tokenizer = tokenizer
        self.tools = list(tools) if tools else None
        self.messages: list[dict[str, Any]] = []
        self.trajectory = Trajectory()
        self._provenance = dict(provenance or {})
        self._last: Completion | None = None
        self.new_segment(messages)

    @property
    def segment(self) -> Segment:
        """The current context window."""
        return self.trajectory.segments[-1]

    def prompt_ids(self) -> list[int]:
        """The exact ids to sample the next turn from (a copy of the current segment)."""
        if self._last is not None:
            raise RuntimeError("the last completion has no observation yet: add_observation first")
        return list(self.segment.token_ids)

    def new_segment(self, messages: Sequence[dict[str, Any]]) -> None:
        """Start a new context window whose prompt is ``messages`` rendered with a generation
        prompt (e.g. after the harness summarised the history to fit the context)."""
        self.messages = [dict(m) for m in messages]
        text = render(self.tokenizer, self.messages, tools=self.tools, add_generation_prompt=True)
        seg = Segment(provenance={**self._provenance, "segment": len(self.trajectory.segments)})
        seg.append_context(encode(self.tokenizer, text), kind="prompt")
        self.trajectory.segments.append(seg)
        self._last = None

    def add_completion(self, completion: Completion, message: dict[str, Any] | None = None) -> None:
        """Append the sampled ids, trainable, with their logprobs and weight version.

        Args:
            completion: what :meth:`Policy.generate` returned for :meth:`prompt_ids`.
            message: the assistant message as the harness parsed it (content, tool calls),
                used only to render later turns; default: the decoded text as content.

        Raises:
            RuntimeError: two completions in a row without an observation between them.
            ValueError: a finish reason other than ``"stop"`` or ``"length"``
                (:func:`coderl.policy.base.check_finish_reason`).
        """
        if self._last is not None:
            raise RuntimeError("add_observation must follow each completion")
        check_finish_reason(completion)
        self.segment.append_sampled(
            completion.token_ids, completion.logprobs, completion.versions()
        )
        self.segment.provenance.setdefault("actions", []).append(
            {"finish_reason": completion.finish_reason, "version": completion.policy_version}
        )
        if message is None:
            text = self.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
            message = {"role": "assistant", "content": text}
        self.messages.append(dict(message))
        self._last = completion

    def untrain_after(self, chars: int, reason: str) -> int:
        """Take the last completion's tokens after its first ``chars`` characters, and one more
        token, out of the loss (:meth:`coderl.trajectory.Segment.untrain`): the tokens that
        write those characters stay trainable, and so does the next one (the choice to stop
        there or go on), every later token of the completion is untrained.

        Args:
            chars: a character offset into the completion's text as ``tokenizer.decode`` (special
                tokens kept) writes it, e.g. where the harness found the end of a ``submit`` call.
            reason: recorded with the untrained run.

        Returns:
            The number of tokens untrained (0 when the completion ends within one token of
            ``chars``).

        Raises:
            RuntimeError: no completion since the last observation.
        """
        if self._last is None:
            raise RuntimeError("untrain_after needs a completion without its observation yet")
        ids = self._last.token_ids
        keep = tokens_covering(self.tokenizer, ids, chars) + 1
        if keep >= len(ids):
            return 0
        return self.segment.untrain(len(self.segment) - len(ids) + keep, reason)

    def add_observation(self, messages: Sequence[dict[str, Any]]) -> bool:
        """Append observation turns (tool results, user messages) after the last completion.

        Returns:
            True if appended as a template delta to the current segment; False if the template
            would rewrite history, so a new segment was started from the full conversation.

        Raises:
            RuntimeError: no completion to follow.
        """
        if self._last is None:
            raise RuntimeError("add_observation must follow a completion")
        new = [dict(m) for m in messages]
        history = self.messages
        before = render(self.tokenizer, history, tools=self.tools, add_generation_prompt=False)
        after = render(self.tokenizer, history + new, tools=self.tools, add_generation_prompt=True)
        if not after.startswith(before):
            self.new_segment(history + new)
            self.segment.provenance["reason"] = "chat template rewrites history"
            return False
        self.segment.append_context(encode(self.tokenizer, self._delta(new)), kind="observation")
        self.messages = history + new
        self._last = None
        return True

    def _delta(self, new: list[dict[str, Any]]) -> str:
        """Text after the sampled tokens: the rest of the assistant turn's closing, the new
        turns and the generation prompt."""
        assert self._last is not None

        def rendered(messages: list[dict[str, Any]], generation_prompt: bool) -> str:
            return render(
                self.tokenizer, messages, tools=self.tools, add_generation_prompt=generation_prompt
            )

        return template_delta(rendered, self.tokenizer, self.messages[:-1], self._last, new)


def tokens_covering(tokenizer: Any, ids: Sequence[int], chars: int) -> int:
    """The fewest leading ``ids`` whose decoded text (special tokens kept) holds the first
    ``chars`` characters of the decoded whole: ``k`` such that ``decode(ids[:k])`` starts with
    ``decode(ids)[:chars]``; the token that writes character ``chars - 1`` is ``ids[k - 1]``.

    Decoding prefixes (not re-tokenizing the text) keeps the sampled ids: a byte-level token
    that ends inside a character decodes to U+FFFD until the rest of it comes. A binary search
    over prefix lengths, each candidate checked; ``len(ids)`` when no shorter prefix holds them.

    Raises:
        ValueError: ``chars`` outside ``[0, len(decode(ids))]``.
    """

    def text(k: int) -> str:
        return str(tokenizer.decode(list(ids[:k]), skip_special_tokens=False))

    whole = text(len(ids))
    if not 0 <= chars <= len(whole):
        raise ValueError(f"character offset {chars} outside a completion of {len(whole)}")
    want = whole[:chars]
    lo, hi = 0, len(ids)  # text(hi) holds want; find the smallest such prefix
    while lo < hi:
        mid = (lo + hi) // 2
        if len(text(mid)) >= chars:
            hi = mid
        else:
            lo = mid + 1
    for k in range(lo, len(ids)):  # lengths need not grow strictly: confirm, never guess
        if text(k).startswith(want):
            return k
    return len(ids)


def template_delta(
    rendered: Callable[[list[dict[str, Any]], bool], str],
    tokenizer: Any,
    history: Sequence[dict[str, Any]],
    last: Completion,
    new: Sequence[dict[str, Any]],
) -> str:
    """The text a template puts after the sampled tokens of ``last`` (the assistant turn that
    follows ``history``): the rest of the turn's closing, the ``new`` turns and the generation
    prompt (see the module docstring). ``rendered(messages, generation_prompt)`` renders a
    conversation as the caller's prompts are rendered (:class:`EpisodeBuilder`'s, or a served
    request's, :mod:`coderl.endpoint.continuation`)."""
    stub = [*history, {"role": "assistant", "content": PLACEHOLDER}]
    before = rendered(stub, False)
    after = rendered([*stub, *new], True)
    closing = before[before.rindex(PLACEHOLDER) + len(PLACEHOLDER) :]
    if last.finish_reason == "stop" and last.token_ids:
        stop_text = tokenizer.decode(last.token_ids[-1:])
        if stop_text and closing.startswith(stop_text):
            closing = closing[len(stop_text) :]
    return closing + after[len(before) :]
