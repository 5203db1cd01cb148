"""The local rollout engine: batched sampling with a KV cache and exact per-token logprobs.

:class:`TorchEngine` implements the :class:`~coderl.policy.base.Engine` protocol on any Hugging
Face causal LM (peft-wrapped or not). One call samples one completion per prompt:

1. prefill: prompts are left-padded into ``[B, P]`` with an attention mask and explicit position
   ids (a row's first real token is at position 0), and only the last position's logits are
   computed (``logits_to_keep=1``);
2. decode: one token per active row per step through the KV cache; rows that sample a stop token
   or exhaust their budget leave the batch at once (the cache rows are dropped), so the batch
   shrinks instead of padding finished rows until the slowest one ends.

Each token's logprob is taken from ``log_softmax(logits / temperature)`` at the step that drew
it, so it is the number the trainer recomputes (see :mod:`coderl.policy.batch`). With ``top_p <
1`` tokens are drawn from the nucleus-truncated distribution but the reported logprob is still
the full tempered one (what a trainer can recompute, as vLLM reports); train with ``top_p = 1``
for exact importance weights. ``finish_reason`` is set by this loop when it stops a row, never
inferred from the last token afterwards.

Limits: one process, one device; no continuous batching across calls, no prefix caching.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import DynamicCache

from coderl.policy.base import Completion, SamplingParams


def check_params(params: SamplingParams) -> None:
    """Raise ValueError with the offending field when ``params`` are out of range."""
    if params.temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {params.temperature}")
    if not 0.0 < params.top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {params.top_p}")
    if params.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {params.max_new_tokens}")


def sample_next(
    logits: Tensor, temperature: float, top_p: float, generator: torch.Generator | None
) -> tuple[Tensor, Tensor]:
    """Draw one token per row and its logprob under ``softmax(logits / temperature)``.

    Sampling uses the exponential-race form of the Gumbel-max trick: ``argmax(p / E)`` with
    ``E ~ Exp(1)`` i.i.d. draws exactly from ``p`` (the form vLLM uses). Nucleus sampling
    (Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration", Sec. 3.1) keeps the
    smallest set of most likely tokens whose mass reaches ``top_p``. ``temperature == 0`` is
    greedy decoding; its logprobs are reported under ``softmax(logits)`` (temperature 1).

    Args:
        logits: ``[b, V]`` float32.
        temperature: >= 0. top_p: in (0, 1]. generator: the RNG (None: the global one).

    Returns:
        ``(tokens [b] int64, logprobs [b] float32)``.
    """
    logp = (logits / (temperature if temperature > 0 else 1.0)).log_softmax(-1)  # (b, V)
    if temperature == 0:
        tok = logits.argmax(-1)
    else:
        probs = logp.exp()  # (b, V)
        if top_p < 1.0:
            sorted_p, order = probs.sort(-1, descending=True)
            outside = sorted_p.cumsum(-1) - sorted_p >= top_p  # (b, V): mass before >= top_p
            sorted_p = sorted_p.masked_fill(outside, 0.0)
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        race = torch.empty_like(probs).exponential_(1.0, generator=generator)
        tok = (probs / race).argmax(-1)
    return tok, logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)


class TorchEngine:
    """Batched KV-cache sampler over a Hugging Face causal LM (see the module docstring).

    Args:
        model: a ``*ForCausalLM`` (or a peft model around one); its current weights are used at
            every call, so weight updates need no sync step.
        eos_token_ids: always stop tokens.
        pad_token_id: written into left padding (never attended to).
    """

    def __init__(self, model: torch.nn.Module, eos_token_ids: list[int], pad_token_id: int):
        self.model = model
        self.eos_token_ids = list(eos_token_ids)
        self.pad_token_id = pad_token_id

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], params: SamplingParams, *, version: int = 0
    ) -> list[Completion]:
        """Sample one completion per prompt; see :meth:`coderl.policy.base.Engine.generate`.

        Raises:
            ValueError: an empty prompt list or prompt, or out-of-range ``params``.
        """
        check_params(params)
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("generate needs a non-empty list of non-empty prompts")
        device = next(self.model.parameters()).device
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device=device).manual_seed(params.seed)
        stop = torch.tensor(sorted(set(self.eos_token_ids) | set(params.stop_token_ids)))
        stop = stop.to(device)

        B, P = len(prompts), max(len(p) for p in prompts)
        ids = torch.full((B, P), self.pad_token_id, dtype=torch.long, device=device)
        mask = torch.zeros(B, P, dtype=torch.long, device=device)
        for b, p in enumerate(prompts):
            ids[b, P - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[b, P - len(p) :] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, P)
        cache = DynamicCache()
        logits = self._step(ids, mask, pos, cache)  # (B, V)
        next_pos = mask.sum(-1)  # (B,) position of the next token
        rows = torch.arange(B, device=device)  # original index of each active row
        out = [Completion(policy_version=version) for _ in range(B)]

        for step in range(params.max_new_tokens):
            tok, lp = sample_next(logits, params.temperature, params.top_p, gen)
            for r, t, x in zip(rows.tolist(), tok.tolist(), lp.tolist(), strict=True):
                out[r].token_ids.append(t)
                out[r].logprobs.append(x)
            stopped = torch.isin(tok, stop)  # (b,)
            if step + 1 == params.max_new_tokens:
                for r, s in zip(rows.tolist(), stopped.tolist(), strict=True):
                    out[r].finish_reason = "stop" if s else "length"
                break
            for r in rows[stopped].tolist():
                out[r].finish_reason = "stop"
            if bool(stopped.all()):
                break
            if bool(stopped.any()):
                keep = (~stopped).nonzero().squeeze(-1)
                cache.batch_select_indices(keep)
                rows, tok, mask, next_pos = rows[keep], tok[keep], mask[keep], next_pos[keep]
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            logits = self._step(tok.unsqueeze(-1), mask, next_pos.unsqueeze(-1), cache)
            next_pos = next_pos + 1
        return out

    def _step(self, ids: Tensor, mask: Tensor, pos: Tensor, cache: DynamicCache) -> Tensor:
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1].float()  # (b, V)
