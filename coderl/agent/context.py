"""Chat-template facts the harness needs: tool support, system prompt, stop tokens, content.

Token-exact assembly of the context windows (prompt rendered once, sampled ids appended as they
came, observation deltas rendered by the chat template and tokenized on their own) is done by
:class:`coderl.policy.episode.EpisodeBuilder`; this module decides what goes into it.

Templates that ignore ``tools=`` (the default SmolLM2 GGUF carries a plain ChatML template) get
the tool definitions and the call format in the system prompt instead, in the documented format
of the episode's :class:`~coderl.agent.parsing.CallFormat`; see :meth:`ChatRenderer.system_prompt`.
Whether a template renders tools is probed by rendering a dummy tool, not guessed from its text.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from coderl.agent.parsing import CallFormat
from coderl.agent.tools import Tool, truncate_middle
from coderl.policy.base import Completion
from coderl.policy.episode import TEMPLATE_FAULTS, encode

Message = dict[str, Any]

_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "coderl_probe_tool_7f3a",
        "description": "probe",
        "parameters": {"type": "object", "properties": {}},
    },
}
# A stand-in conversation to find the text a template puts after an assistant turn.
_STAND_IN: list[Message] = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "U"},
    {"role": "assistant", "content": "A"},
]


class TemplateError(ValueError):
    """The tokenizer's chat template cannot be used for token-exact multi-turn rendering."""


def template_supports_tools(tokenizer: Any) -> bool:
    """True when the chat template renders the ``tools=`` it is given (probed with a dummy tool).

    Raises:
        TemplateError: the tokenizer has no chat template.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise TemplateError("the tokenizer has no chat template; set tokenizer.chat_template")
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "x"}], tools=[_PROBE_TOOL], tokenize=False
        )
    except TEMPLATE_FAULTS:  # a template that rejects tools= does not support them
        return False
    return _PROBE_TOOL["function"]["name"] in text  # type: ignore[index]


@dataclass
class ChatRenderer:
    """The chat-template side of one episode: where the tools are shown, which tokens end a
    turn, what the opening messages are, what text a completion carries.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        tools: the episode's tools, in the order they are shown.
        call_format: the tool-call format the model is told to use.
        instructions: the task-independent part of the system prompt.
        template_tools: let a template that renders ``tools=`` show the tools (it then also
            describes its own call format); False always uses the call format's own section.
    """

    tokenizer: Any
    tools: Mapping[str, Tool]
    call_format: CallFormat
    instructions: str
    template_tools: bool = True
    native_tools: bool = field(init=False)
    """Whether the template shows the tools (else the system prompt carries them)."""
    closing: str = field(init=False)
    """Template text after an assistant message's content (e.g. ``"<|im_end|>\\n"``)."""
    stop_token_ids: tuple[int, ...] = field(init=False)
    """Token ids that end a turn: the EOS and the end-of-turn token of the template."""

    def __post_init__(self) -> None:
        self.native_tools = self.template_tools and template_supports_tools(self.tokenizer)
        prompt = self._render(_STAND_IN[:2], generation_prompt=True)
        full = self._render(_STAND_IN, generation_prompt=False)
        if not full.startswith(prompt + "A"):
            raise TemplateError(
                "the chat template does not render an assistant turn as generation prompt + "
                f"content; got {full[len(prompt) - 20 :]!r}"
            )
        self.closing = full[len(prompt) + 1 :]
        stops = {self.tokenizer.eos_token_id}
        closing_ids = self.tokenizer.encode(self.closing, add_special_tokens=False)
        if closing_ids and closing_ids[0] in self.tokenizer.all_special_ids:
            stops.add(closing_ids[0])
        self.stop_token_ids = tuple(sorted(i for i in stops if i is not None))

    def system_prompt(self) -> str:
        """The system message: the instructions, plus the tool definitions and call format when
        the template does not render ``tools=`` itself (``CallFormat.instructions``)."""
        if self.native_tools:
            return self.instructions
        return f"{self.instructions}\n\n{self.call_format.instructions(self.tools)}"

    def opening(self, user_message: str) -> list[Message]:
        """The first messages of a context window: the system prompt and ``user_message``."""
        return [
            {"role": "system", "content": self.system_prompt()},
            {"role": "user", "content": user_message},
        ]

    def _render(self, messages: Sequence[Message], *, generation_prompt: bool) -> str:
        return str(
            self.tokenizer.apply_chat_template(
                list(messages),
                tools=self.tool_schemas(),
                tokenize=False,
                add_generation_prompt=generation_prompt,
            )
        )

    def tool_schemas(self) -> list[dict[str, Any]] | None:
        """What to pass as the template's ``tools=``: the schemas when it renders them."""
        return [t.schema for t in self.tools.values()] if self.native_tools else None

    def content(self, completion: Completion) -> str:
        """The assistant message's text: the sampled tokens without a final stop token."""
        ids = completion.token_ids
        if ids and ids[-1] in self.stop_token_ids:
            ids = ids[:-1]
        return str(self.tokenizer.decode(ids, skip_special_tokens=False))


def cap_tokens(tokenizer: Any, text: str, max_tokens: int) -> str:
    """``text`` cut in the middle (:func:`coderl.agent.tools.truncate_middle`) until it encodes
    to at most ``max_tokens`` tokens: a character cap alone lets 8,000 characters of emoji cost
    24,000 tokens. Each cut keeps the share of characters the token budget, less 32 tokens for
    the marker, allows; it stops when a cut no longer shortens the text (``max_tokens`` below
    the marker's own tokens)."""
    n = len(encode(tokenizer, text))
    while n > max_tokens:
        cut = truncate_middle(text, max(1, len(text) * (max_tokens - 32) // n))
        if len(cut) >= len(text):
            break
        text, n = cut, len(encode(tokenizer, cut))
    return text
