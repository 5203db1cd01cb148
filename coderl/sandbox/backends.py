"""Backend name -> sandbox class: the only place a name selects a sandbox implementation."""

from __future__ import annotations

from coderl.sandbox.bwrap import BwrapSandbox
from coderl.sandbox.local import LocalSandbox

BACKENDS = {
    "bwrap": BwrapSandbox,
    "local": LocalSandbox,
}
"""``Sandbox.create(..., backend=NAME)`` builds ``BACKENDS[NAME](base, limits=..., ...)``."""
