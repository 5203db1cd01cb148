"""Run an ASGI app with uvicorn in a daemon thread: ``coderl serve``'s app in tests, the demo and
``online run``, and the gateway's per-rollout endpoint (:mod:`coderl.envs.gateway`)."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn
from fastapi import FastAPI


class BackgroundServer:
    """Run an ASGI app with uvicorn in a daemon thread (tests, the demo, ``online run``).

    Args:
        app: the FastAPI app.
        host, port: where to listen; port 0 picks a free port (read :attr:`port` after start).
        sock: a socket bound already (``coderl online run`` binds before the model loads, so a
            port in use is refused in a second); host and port are then its own.

    Raises:
        ValueError: the address cannot be bound (in use, or not this host's); the message names
            ``online.serve.host`` / ``port``, so ``coderl online run`` prints one line.
        RuntimeError: the server did not start within 30 s.
    """

    def __init__(
        self,
        app: FastAPI,
        host: str = "127.0.0.1",
        port: int = 0,
        sock: socket.socket | None = None,
    ) -> None:
        if sock is None:
            sock = socket.socket()
            try:
                sock.bind((host, port))
            except OSError as err:
                sock.close()
                raise ValueError(
                    f"online.serve.host/port: cannot listen on {host}:{port}: {err.strerror} "
                    "(online.serve.port=0 picks a free port)"
                ) from err
        self._sock = sock
        self.host, self.port = str(sock.getsockname()[0]), int(sock.getsockname()[1])
        config = uvicorn.Config(app, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )
        self._thread.start()
        deadline = time.time() + 30
        while not self._server.started:
            if time.time() > deadline or not self._thread.is_alive():
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()
