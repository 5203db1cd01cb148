"""Container images made here, without any image registry, tagged by the hash of their inputs.

Every command here is one that podman's and docker's CLIs both take (``coderl.sandbox.container``
picks the CLI; only podman was run here). Layers: a Debian *base* image built from Debian's
packages (``mmdebstrap``, then ``podman import``); *layers* on top of a parent image built from a Containerfile body and a context
directory (``podman build``; pip installs reach PyPI through the host network, with the host's CA
bundle copied in). Each image is tagged ``localhost/coderl-<kind>:<hash>`` where the hash covers
every input (parent image id, Containerfile text, context file names and bytes), so an image is
built once, found again by its tag, and rebuilt only when an input changes.

Also: :func:`image_testbed`, the host copy of an image's ``/testbed`` (the read-only base a
container sandbox's workspace overlays, for instances whose repository lives in their image).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from coderl.sandbox.base import SandboxError
from coderl.sandbox.container import container_cli, run_cli

BASE_SUITE = "bookworm"
BASE_PACKAGES = (
    "python3",
    "python3-venv",
    "python3-pip",
    "git",
    "patch",
    "ca-certificates",
    "tzdata",
    "gettext",
)
"""Debian packages of the base image: a Python to build environments with, git and patch, the
shared libraries the host Python (mounted from the host) links against, and what bwrap
sandboxes see through the host's ``/usr`` that shipped test suites use: the time zone data
(without it python-dateutil's ``tz`` tests failed in containers and passed in bwrap) and
gettext's ``xgettext``/``msgmerge``/``msgfmt`` (without them humanize's
``test_update_translations`` skipped in containers and passed in bwrap)."""
CACHE_DIR = Path(os.environ.get("CODERL_IMAGE_CACHE") or "/var/tmp/coderl-images")
"""Host directory for build scratch and the exported ``/testbed`` trees."""
CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"


def _key(*parts: str | bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        h.update(len(data).to_bytes(8, "little") + data)
    return h.hexdigest()[:16]


def image_exists(tag: str) -> bool:
    """True when ``tag`` is in local image storage (``image inspect``: docker has no
    ``image exists``)."""
    done = subprocess.run(
        [*container_cli(), "image", "inspect", "--format", "{{.Id}}", tag],
        stdin=subprocess.DEVNULL,
        capture_output=True,
    )
    return done.returncode == 0


def image_id(tag: str) -> str:
    """The image id of ``tag``. Raises SandboxError when it does not exist."""
    return run_cli(["image", "inspect", "--format", "{{.Id}}", tag]).strip()


def base_image(*, suite: str = BASE_SUITE, packages: tuple[str, ...] = BASE_PACKAGES) -> str:
    """The Debian base image's tag, built with ``mmdebstrap`` (1-3 minutes, network to Debian's
    mirrors) when it is not in local storage. Raises SandboxError (mmdebstrap missing or
    failed, import failed)."""
    tag = f"localhost/coderl-base:{_key('base-v1', suite, *sorted(packages))}"
    if image_exists(tag):
        return tag
    if shutil.which("mmdebstrap") is None:
        raise SandboxError("mmdebstrap is not installed (make sysdeps)")
    with _building(tag) as done_meanwhile:
        if not done_meanwhile:
            _debootstrap(tag, suite, packages)
    return tag


@contextlib.contextmanager
def _building(tag: str) -> Iterator[bool]:
    """Hold ``tag``'s build lock (a file lock under ``CACHE_DIR``: one build of a tag at a time
    across processes; a second build would re-point the tag to another image id, and every
    layer hashed over the first id would be built again); yields True when another process built
    the image while this one waited."""
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    lock = CACHE_DIR / f".{tag.rsplit('/', 1)[-1].replace(':', '-')}.lock"
    with open(lock, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield image_exists(tag)


def _debootstrap(tag: str, suite: str, packages: tuple[str, ...]) -> None:
    with tempfile.TemporaryDirectory(dir=CACHE_DIR, prefix=".base-") as tmp:
        tar = f"{tmp}/rootfs.tar"
        argv = ["mmdebstrap", "--variant=apt", f"--include={','.join(packages)}", suite, tar]
        done = subprocess.run(argv, capture_output=True, stdin=subprocess.DEVNULL)
        if done.returncode != 0:
            tail = done.stderr.decode(errors="replace").strip().splitlines()[-3:]
            raise SandboxError(f"mmdebstrap failed: {' | '.join(tail)}")
        run_cli(["import", "--change", 'CMD ["/bin/bash"]', tar, tag], timeout=600)


def build_layer(
    kind: str,
    parent: str,
    containerfile: str,
    context: Path | None = None,
    *,
    pip: bool = True,
    copy: dict[str, Path] | None = None,
) -> str:
    """Build ``containerfile`` (its body, without the ``FROM`` line) on ``parent`` and return the
    image's tag ``localhost/coderl-<kind>:<hash>``; an existing tag is returned without building.

    context: directory whose files the body may ``COPY`` (hashed by names and bytes).
    pip: copy the host CA bundle in as ``/etc/ssl/certs/host-ca.crt`` and point pip at it
        (``PIP_CERT``), with the build on the host network.
    copy: name -> host directory, put into the build context under that name and NOT hashed:
        the caller hashes them through a file of ``context`` (a content digest it holds).
    Raises SandboxError (the parent is missing, the build failed).
    """
    parts: list[str | bytes] = ["layer-v1", kind, image_id(parent), containerfile, str(pip)]
    if context is not None:
        for path in sorted(p for p in Path(context).rglob("*") if p.is_file()):
            parts += [str(path.relative_to(context)), path.read_bytes()]
    tag = f"localhost/coderl-{kind}:{_key(*parts)}"
    if image_exists(tag):
        return tag
    with _building(tag) as done_meanwhile:
        if not done_meanwhile:
            _build(tag, parent, containerfile, context, pip, copy or {})
    return tag


def _build(
    tag: str,
    parent: str,
    containerfile: str,
    context: Path | None,
    pip: bool,
    copy: dict[str, Path],
) -> None:
    with tempfile.TemporaryDirectory(dir=CACHE_DIR, prefix=".build-") as tmp:
        ctx = Path(tmp) / "ctx"
        if context is not None:
            shutil.copytree(context, ctx, symlinks=True)
        else:
            ctx.mkdir()
        for name, tree in copy.items():
            shutil.copytree(tree, ctx / name, symlinks=True)
        head = f"FROM {parent}\n"
        if pip:
            shutil.copy(CA_BUNDLE, ctx / ".host-ca.crt")
            head += "COPY .host-ca.crt /etc/ssl/certs/host-ca.crt\n"
            head += "ENV PIP_CERT=/etc/ssl/certs/host-ca.crt PIP_DISABLE_PIP_VERSION_CHECK=1\n"
        (Path(tmp) / "Containerfile").write_text(head + containerfile)
        argv = ["build", "--network", "host" if pip else "none", "-t", tag]
        run_cli([*argv, "-f", f"{tmp}/Containerfile", str(ctx)], timeout=1800)


def image_testbed(image: str) -> Path:
    """Host copy of ``image``'s ``/testbed`` (cached under ``CACHE_DIR/testbeds/<image id>``): the
    read-only base of a container sandbox for an instance whose repository lives in its image.
    Raises SandboxError (no such image, no ``/testbed`` in it)."""
    ident = image_id(image)
    dest = CACHE_DIR / "testbeds" / ident[:32]
    if dest.is_dir():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=".copy-"))
    name = f"coderl-export-{os.getpid()}-{ident[:12]}"
    try:
        run_cli(["create", "--name", name, image, "/bin/true"])
        try:
            run_cli(["cp", f"{name}:/testbed/.", str(tmp)], timeout=600)
        finally:
            run_cli(["rm", "-f", name], check=False)
        tmp.rename(dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest
