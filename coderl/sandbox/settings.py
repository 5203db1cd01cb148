"""A run's sandbox backend, set for the process and the workers it starts (environment
variables, so spawned processes inherit them), and put back when the run ends."""

from __future__ import annotations

import os

from coderl.sandbox.base import BACKEND_ENV
from coderl.sandbox.container import CLI_ENV, IMAGE_ENV


def use_backend(
    backend: str, image: str | None = None, cli: str | None = None
) -> dict[str, str | None]:
    """Make ``backend`` the default of ``Sandbox.create`` (and ``image`` the container image:
    given, or the Debian base built by :func:`coderl.sandbox.images.base_image` when
    ``backend == "container"``; ``cli`` the container CLI, None: found on PATH). Returns the
    previous values for :func:`restore_backend`. Raises SandboxError (the base image cannot be
    built)."""
    before = {k: os.environ.get(k) for k in (BACKEND_ENV, IMAGE_ENV, CLI_ENV)}
    if cli is not None:
        os.environ[CLI_ENV] = cli
    if backend == "container" and image is None:
        from coderl.sandbox.images import base_image

        try:
            image = base_image()
        except BaseException:
            restore_backend(before)
            raise
    os.environ[BACKEND_ENV] = backend
    if image is not None:
        os.environ[IMAGE_ENV] = image
    return before


def restore_backend(before: dict[str, str | None]) -> None:
    """Put back the variables :func:`use_backend` replaced."""
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
