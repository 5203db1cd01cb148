"""The ``sandbox:`` section: which sandbox backend rollouts and grading run in."""

from __future__ import annotations

from typing import Literal

from coderl.config._base import _Section


class SandboxConfig(_Section):
    backend: Literal["bwrap", "container"] = "bwrap"
    """Where every rollout, build and grade of the run executes: ``bwrap`` (bubblewrap
    namespaces, ``coderl.sandbox.bwrap``) or ``container`` (one podman or docker container per sandbox,
    ``coderl.sandbox.container``; docs/environments.md, "Containers"). Applied for the run by
    ``coderl.train.run.setup_run`` (train, train-async, eval) and inherited by worker processes."""
    image: str | None = None
    """The container image (``backend=container``): a local tag or a registry name the user's
    podman can pull. None: the Debian base image coderl builds here from Debian's packages
    (``coderl.sandbox.images.base_image``; 1-3 minutes the first time, then cached)."""
    cli: str | None = None
    """The container CLI (``backend=container``): ``podman``, ``docker`` or a path to either.
    None: podman when installed, else docker (``coderl.sandbox.container.container_cli``; only
    podman was run here, docker's command lines are tested against a stand-in)."""
