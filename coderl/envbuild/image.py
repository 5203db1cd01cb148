"""A built environment as a container image, in layers: ``coderl tasks build-env SPEC --image``.

Layers (``coderl.sandbox.images``; each tagged by the hash of its inputs, found again by that tag
and rebuilt only when an input changes):

1. the Debian base (``localhost/coderl-base:<hash>``: Debian's packages, no registry);
2. the environment (``localhost/coderl-env:<hash>``): the repository snapshot at ``/testbed`` and a
   virtualenv at ``/venv`` made by the install plan that worked for the host build
   (``EnvRecord.install_commands``), the project itself uninstalled and ``/testbed`` put on the
   path by a ``.pth`` file, exactly as ``coderl.envbuild.build`` leaves a host environment; the
   hash covers the base image id, the snapshot's digest and the install commands.

The image is self-contained (its own Debian Python 3.11, the same minor version the host build
used through ``/usr/bin/python3``): it runs the repository's tests with ``/venv/bin/python -m pytest``
anywhere podman or docker runs, which is what an instance image of SWE-bench is. coderl's own
container sandboxes keep mounting the host's ``/venv`` over it (``Sandbox.create`` mounts), so
that grading here stays one code path; a user elsewhere runs the image as it is.

Not done: an instance layer per task (the task's starting state is a diff applied at rollout
time, not baked in).
"""

from __future__ import annotations

import json
import shlex
import tempfile
from pathlib import Path

from coderl.grading.runner import SITE
from coderl.sandbox.images import base_image, build_layer
from coderl.tasks.env import EnvRecord


def containerfile(env: EnvRecord) -> str:
    """The environment layer's Containerfile body (after ``FROM``) for ``env``."""
    dist = shlex.quote(env.name)
    src = (
        "/testbed"
        if env.info.get("source_root", ".") == "."
        else f"/testbed/{env.info['source_root']}"
    )
    steps = [
        "python3 -m venv /venv",
        "cp -r /testbed /tmp/src",
        "cd /tmp/src",
        *env.install_commands,
        f"(/venv/bin/python -m pip uninstall -y -q {dist} || true)",
        f"echo {src} > {SITE}/coderl_testbed.pth",
        "cd / && rm -rf /tmp/src /root/.cache",
    ]
    return (
        "COPY testbed /testbed\n"
        f"RUN {' && '.join(steps)}\n"
        "WORKDIR /testbed\n"
        f'LABEL coderl.env_id="{env.env_id}" coderl.snapshot="{env.snapshot_digest}"\n'
    )


def build_env_image(env: EnvRecord) -> str:
    """The tag of ``env``'s image (built when missing; see the module docstring); also written to
    ``<env dir>/image.json``. Raises SandboxError (podman or mmdebstrap missing, a build failed)."""
    base = base_image()
    with tempfile.TemporaryDirectory(prefix="coderl-envimage-") as tmp:
        ctx = Path(tmp)
        # the snapshot's digest names its content: link rather than hash 10,000 files again
        (ctx / "testbed.digest").write_text(env.snapshot_digest)
        body = containerfile(env)
        tag = build_layer("env", base, body, ctx, pip=True, copy={"testbed": Path(env.snapshot)})
    record = Path(env.venv).parent / "image.json"
    record.write_text(json.dumps({"image": tag, "base": base, "env_id": env.env_id}) + "\n")
    return tag
