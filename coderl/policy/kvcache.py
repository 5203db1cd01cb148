"""Decoding backends for :class:`~coderl.policy.engine.TorchEngine`: how the model is run for
one prefill and then one token per active row per step.

- :class:`HFCacheBackend`: the model's own forward with a transformers ``DynamicCache``; works
  for any causal LM; prompts are left-padded with explicit position ids.
- :class:`StaticCacheBackend`: for Llama / Qwen2 / Mistral-style decoders (the
  ``*ForCausalLM.model.layers[i].{input_layernorm, self_attn.{q,k,v,o}_proj,
  post_attention_layernorm, mlp}`` layout with rotary embeddings), a preallocated ragged KV cache
  written in place: each prompt is prefilled on its own (no padding; identical prompts, as in a
  GRPO group, are prefilled once; the common prefix of the call's distinct prompts, such as a
  harness's system prompt with its tool definitions, is prefilled once and copied), decode steps append at each row's own position, and attention
  reads only the filled part of the cache. It calls the model's own modules (norms, projections,
  MLPs, rotary embedding), so peft LoRA layers and ``disable_adapter`` work unchanged; only the
  attention product and the cache are ours.

The static backend also reuses KV across calls: a prompt that extends a sequence held by a
:class:`~coderl.policy.prefixcache.PrefixCache` (an agent's previous turn) copies that KV and
prefills only the rest, and ``export`` hands a finished row's KV back for the cache.

A backend's ``drop(keep)`` is told which rows are still active; the static backend compacts its
cache only once a quarter of its rows have finished (finished rows in between decode a pad token
whose output is ignored), so finishing rows do not each cost a full cache copy.

Limits: no sliding-window attention, no attention soft-capping, no bias-free variants beyond what
the model's own modules do; :data:`STATIC_MODEL_TYPES` lists the architectures checked.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from peft import PeftModel
from torch import Tensor
from transformers import DynamicCache

from coderl.policy.prefixcache import PrefixCache

# model_type values whose decoder layout the static backend reproduces exactly.
STATIC_MODEL_TYPES = frozenset({"llama", "qwen2", "mistral"})


def causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The ``*ForCausalLM`` inside ``model`` (unwrapping peft; LoRA layers stay injected)."""
    return model.get_base_model() if isinstance(model, PeftModel) else model


def supports_static(model: torch.nn.Module) -> bool:
    """Whether :class:`StaticCacheBackend` reproduces this model's forward."""
    config = causal_lm(model).config
    sliding = getattr(config, "use_sliding_window", False) or "sliding_attention" in (
        getattr(config, "layer_types", None) or []
    )
    if config.model_type == "mistral":
        sliding = getattr(config, "sliding_window", None) is not None
    return config.model_type in STATIC_MODEL_TYPES and not sliding


MIN_SHARED_PREFIX = 16
"""Distinct prompts of one call whose common prefix is at least this many tokens prefill it once."""


def shared_prefix_len(prompts: list[tuple[int, ...]] | list[list[int]]) -> int:
    """Length of the longest common prefix of ``prompts``, at most the shortest length minus 1
    (every prompt keeps one token of its own, whose logits start its completion)."""
    n = min(len(p) for p in prompts) - 1
    ref = prompts[0]
    for p in prompts[1:]:
        n = min(n, next((j for j in range(n) if p[j] != ref[j]), n))
    return max(n, 0)


class HFCacheBackend:
    """Any causal LM through its own forward and a ``DynamicCache`` (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, pad_token_id: int):
        self.model = model
        self.pad_token_id = pad_token_id

    def start(self, prompts: list[list[int]], reuse: PrefixCache | None = None) -> Tensor:
        """Prefill left-padded prompts; returns next-token logits ``[B, V]`` float32. ``reuse``
        is not read: this backend prefills every prompt in full."""
        device = next(self.model.parameters()).device
        B, P = len(prompts), max(len(p) for p in prompts)
        ids = torch.full((B, P), self.pad_token_id, dtype=torch.long, device=device)
        self.mask = torch.zeros(B, P, dtype=torch.long, device=device)
        for b, p in enumerate(prompts):
            ids[b, P - len(p) :] = torch.tensor(p, dtype=torch.long)
            self.mask[b, P - len(p) :] = 1
        pos = (self.mask.cumsum(-1) - 1).clamp(min=0)  # (B, P)
        self.prefilled, self.reused = B * P, 0  # padding included: it is computed
        self.attended = B * P * (P + 1) // 2  # causal query-key pairs, padding included
        self.cache = DynamicCache()
        self.next_pos = self.mask.sum(-1)  # (B,)
        return self._forward(ids, pos)

    def drop(self, keep: Tensor) -> None:
        """Keep only rows ``keep`` (indices into the current active rows)."""
        self.cache.batch_select_indices(keep)
        self.mask, self.next_pos = self.mask[keep], self.next_pos[keep]

    def step(self, tokens: Tensor) -> Tensor:
        """Append one token per active row ``[b]``; returns logits ``[b, V]`` float32."""
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)
        logits = self._forward(tokens.unsqueeze(-1), self.next_pos.unsqueeze(-1))
        self.next_pos = self.next_pos + 1
        return logits

    def _forward(self, ids: Tensor, pos: Tensor) -> Tensor:
        out = self.model(
            input_ids=ids,
            attention_mask=self.mask,
            position_ids=pos,
            cache=self.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1].float()  # (b, V)


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary position embedding (Su et al. 2021, "RoFormer", Eq. 34), rotate-half layout as in
    transformers' Llama: ``x * cos + rotate_half(x) * sin``. x: ``[..., D]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class StaticCacheBackend:
    """Ragged preallocated KV cache over a Llama-layout decoder (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, pad_token_id: int, max_new_tokens: int):
        lm = causal_lm(model)
        self.decoder, self.lm_head, config = lm.model, lm.lm_head, lm.config
        self.pad_token_id = pad_token_id
        self.max_new_tokens = max_new_tokens
        self.H = config.num_attention_heads
        self.KV = config.num_key_value_heads
        self.D = getattr(config, "head_dim", None) or config.hidden_size // self.H
        self.scale = 1.0 / math.sqrt(self.D)

    def start(self, prompts: list[list[int]], reuse: PrefixCache | None = None) -> Tensor:
        """Prefill each distinct prompt once, their common prefix once for all of them, and only
        the part after the cached sequence it extends where ``reuse`` holds one at least as
        long as that common prefix; returns next-token logits ``[B, V]`` float32."""
        emb = self.decoder.embed_tokens.weight
        B, L = len(prompts), len(self.decoder.layers)
        cap = max(len(p) for p in prompts) + self.max_new_tokens
        shape = (L, B, self.KV, cap, self.D)
        self.k = torch.zeros(shape, dtype=emb.dtype, device=emb.device)
        self.v = torch.zeros(shape, dtype=emb.dtype, device=emb.device)
        self.length = torch.tensor([len(p) for p in prompts], device=emb.device)  # (B,)
        self.active = torch.ones(B, dtype=torch.bool, device=emb.device)
        self.prefilled = self.reused = 0  # tokens run through the model / read from ``reuse``
        self.attended = 0  # query-key pairs of the prefills (per head and layer)
        logits = torch.empty(B, self.lm_head.out_features, device=emb.device)
        first: dict[tuple[int, ...], int] = {}
        for b, p in enumerate(prompts):
            first.setdefault(tuple(p), b)
        S = shared_prefix_len(list(first)) if len(first) > 1 else 0
        S = S if S >= MIN_SHARED_PREFIX else 0  # e.g. the system prompt and tool definitions
        start = {b: 0 for b in first.values()}  # cache positions already filled per row
        for b in first.values():
            entry, m = reuse.lookup(prompts[b]) if reuse is not None else (None, 0)
            if entry is not None and m >= max(S, 1):
                self.k[:, b, :, :m] = entry.k[:, :, :m]
                self.v[:, b, :, :m] = entry.v[:, :, :m]
                start[b], self.reused = m, self.reused + m
        rest = [b for b, s in start.items() if s == 0]
        if S and rest:
            a = rest[0]
            self._prefill(a, torch.tensor(prompts[a][:S], device=emb.device), 0)
            for b in rest:
                self.k[:, b, :, :S] = self.k[:, a, :, :S]
                self.v[:, b, :, :S] = self.v[:, a, :, :S]
                start[b] = S
        for b, p in enumerate(prompts):
            a = first[tuple(p)]
            if a != b:  # same prompt (a GRPO group): copy its cache rows and logits
                self.k[:, b, :, : len(p)] = self.k[:, a, :, : len(p)]
                self.v[:, b, :, : len(p)] = self.v[:, a, :, : len(p)]
                logits[b] = logits[a]
                continue
            logits[b] = self._prefill(b, torch.tensor(p[start[b] :], device=emb.device), start[b])
        return logits

    def export(self, keep: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Copies of the filled cache of active rows ``keep`` (indices into the active rows):
        per row ``(k, v)``, each ``[L, KV, n, D]`` with ``n`` the tokens run through the model
        in that row (its prompt and every sampled token but the last)."""
        rows = self.active.nonzero().squeeze(-1)[keep]
        out = []
        for r in rows.tolist():
            n = int(self.length[r])
            out.append((self.k[:, r, :, :n].clone(), self.v[:, r, :, :n].clone()))
        return out

    def row_bytes(self, keep: Tensor) -> list[int]:
        """Bytes :meth:`export` would copy per active row ``keep`` (indices into active rows)."""
        rows = self.active.nonzero().squeeze(-1)[keep]
        per_token = 2 * self.k.shape[0] * self.KV * self.D * self.k.element_size()
        return [int(self.length[r]) * per_token for r in rows.tolist()]

    def drop(self, keep: Tensor) -> None:
        """Rows not in ``keep`` finished; compact once a quarter of the cache rows are idle."""
        rows = self.active.nonzero().squeeze(-1)
        self.active[:] = False
        self.active[rows[keep]] = True
        if int(self.active.sum()) <= 0.75 * self.active.numel():
            idx = self.active.nonzero().squeeze(-1)
            self.k = self.k[:, idx].contiguous()
            self.v = self.v[:, idx].contiguous()
            self.length, self.active = self.length[idx], self.active[idx]

    def step(self, tokens: Tensor) -> Tensor:
        """Append one token per active row ``[b]``; returns logits ``[b, V]`` float32."""
        all_tokens = torch.full_like(self.length, self.pad_token_id)
        all_tokens[self.active] = tokens
        logits = self._decode(all_tokens)  # (R, V) over every cache row
        return logits[self.active]

    @torch.no_grad()
    def _prefill(self, row: int, ids: Tensor, start: int) -> Tensor:
        """Write the cache of ``ids`` (``[T]``) at positions ``start .. start + T - 1`` of
        ``row``, attending to the ``start`` cached positions before them; returns the logits
        after the last one (``[V]`` float32)."""
        T, end = ids.shape[0], start + ids.shape[0]
        self.prefilled += T
        self.attended += T * start + T * (T + 1) // 2  # query start + j sees start + j + 1
        x = self.decoder.embed_tokens(ids)[None]  # (1, T, hidden)
        positions = torch.arange(start, end, device=ids.device)
        cos, sin = self.decoder.rotary_emb(x, positions[None])
        cos, sin = cos[:, None], sin[:, None]  # (1, 1, T, D)
        # query at position start + j sees cache positions <= start + j
        mask = None if start == 0 else torch.arange(end, device=ids.device) <= positions[:, None]
        for i, layer in enumerate(self.decoder.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = _rope(attn.q_proj(h).view(1, T, self.H, self.D).transpose(1, 2), cos, sin)
            k = _rope(attn.k_proj(h).view(1, T, self.KV, self.D).transpose(1, 2), cos, sin)
            v = attn.v_proj(h).view(1, T, self.KV, self.D).transpose(1, 2)  # (1, KV, T, D)
            self.k[i, row, :, start:end] = k[0].to(self.k.dtype)  # autocast: bf16 into fp32
            self.v[i, row, :, start:end] = v[0].to(self.v.dtype)
            keys, values = self.k[i, row : row + 1, :, :end], self.v[i, row : row + 1, :, :end]
            o = F.scaled_dot_product_attention(
                q,
                keys,
                values,
                attn_mask=mask,
                is_causal=mask is None,
                scale=self.scale,
                enable_gqa=True,
            )  # (1, H, T, D)
            x = x + attn.o_proj(o.transpose(1, 2).reshape(1, T, self.H * self.D))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.lm_head(self.decoder.norm(x[:, -1])).float()[0]  # (V,)

    @torch.no_grad()
    def _decode(self, tokens: Tensor) -> Tensor:
        R = tokens.shape[0]
        pos = self.length  # (R,) where each row's new token goes
        T = int(pos.max()) + 1  # filled part of the cache after this step
        x = self.decoder.embed_tokens(tokens)[:, None]  # (R, 1, hidden)
        cos, sin = self.decoder.rotary_emb(x, pos[:, None])
        cos, sin = cos[:, None], sin[:, None]  # (R, 1, 1, D)
        rows = torch.arange(R, device=tokens.device)
        visible = torch.arange(T, device=tokens.device)[None] <= pos[:, None]  # (R, T)
        visible = visible[:, None, None]  # (R, 1, 1, T) bool: True = attend
        for i, layer in enumerate(self.decoder.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = _rope(attn.q_proj(h).view(R, 1, self.H, self.D).transpose(1, 2), cos, sin)
            k = _rope(attn.k_proj(h).view(R, 1, self.KV, self.D).transpose(1, 2), cos, sin)
            v = attn.v_proj(h).view(R, self.KV, self.D)
            self.k[i, rows, :, pos] = k[:, :, 0].to(self.k.dtype)
            self.v[i, rows, :, pos] = v.to(self.v.dtype)
            # SDPA's fused CPU kernel reads the (R, KV, T, D) cache once per KV head (the two
            # bmm's it replaces cost 2.7 ms per layer in fp32 and 3.8 in bf16 at R=32, T=400;
            # SDPA 2.4 and 1.2); query head h reads KV head h // (H / KV), as transformers' GQA.
            o = F.scaled_dot_product_attention(
                q,
                self.k[i, :, :, :T],
                self.v[i, :, :, :T],
                attn_mask=visible,
                scale=self.scale,
                enable_gqa=True,
            )  # (R, H, 1, D)
            x = x + attn.o_proj(o.transpose(1, 2).reshape(R, 1, self.H * self.D))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        self.length = self.length + 1
        return self.lm_head(self.decoder.norm(x[:, 0])).float()  # (R, V)
