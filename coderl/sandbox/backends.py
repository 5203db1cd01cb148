"""Backend name -> sandbox class: fills ``coderl.sandbox.base.BACKENDS``, the only place a name
selects a sandbox implementation (imported by the ``coderl.sandbox`` package, so every import of
a sandbox module has it)."""

from __future__ import annotations

from coderl.sandbox.base import BACKENDS
from coderl.sandbox.bwrap import BwrapSandbox
from coderl.sandbox.container import ContainerSandbox
from coderl.sandbox.local import LocalSandbox

BACKENDS.update({"bwrap": BwrapSandbox, "container": ContainerSandbox, "local": LocalSandbox})

__all__ = ["BACKENDS"]
