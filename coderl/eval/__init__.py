"""Evaluation: pass@k and best-of-n with confidence intervals, and run reports.

The names below load :mod:`coderl.eval.passk` (and torch with it) on first use, so that
``coderl eval --help`` imports only the command line.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["EvalResult", "Estimate", "evaluate", "paired_difference", "summarize"]


def __getattr__(name: str) -> Any:  # PEP 562: a lazy module attribute
    if name in __all__:
        return getattr(importlib.import_module("coderl.eval.passk"), name)
    raise AttributeError(f"module 'coderl.eval' has no attribute {name!r}")
