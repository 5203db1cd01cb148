"""Plain values as JSON, for the function checker's process seams (standard library only).

The candidate's process sends its return values to the judge through this format, so decoding is
the only place where bytes the candidate chose become objects in a trusted process. Decoding
builds fresh builtin objects only (no pickle, no ``eval``, no user classes) and is bounded: at
most ``MAX_DEPTH`` levels of nesting and ``MAX_NODES`` values per document; the caller bounds the
text's length.

Format: ``None``, ``bool``, ``int``, ``float`` (``NaN``/``Infinity`` allowed), ``str`` and ``list``
are JSON's own; every other type is a one-key object: ``{"tuple": [...]}``, ``{"set": [...]}``,
``{"frozenset": [...]}``, ``{"dict": [[key, value], ...]}``, ``{"bytes": "<hex>"}``,
``{"complex": [re, im]}``. Only exact builtin types encode (``type(v) is int``, not a subclass),
so an object whose ``__eq__`` always answers True cannot cross.
"""

from __future__ import annotations

import json
from typing import Any

MAX_DEPTH = 100
"""Deepest nesting accepted by :func:`encode` and :func:`decode`."""
MAX_NODES = 2_000_000
"""Most values (scalars and containers) one :func:`decode` call builds."""

_SCALARS = (type(None), bool, int, float, str)
_TAGGED = ("tuple", "set", "frozenset", "dict", "bytes", "complex")


class WireError(ValueError):
    """A value that cannot be encoded, or a document that is not valid wire format."""


def encode(value: Any, _depth: int = 0) -> Any:
    """``value`` as a JSON-ready structure. Raises WireError for any type outside the format
    (including subclasses of builtins) and for nesting deeper than ``MAX_DEPTH``."""
    if _depth > MAX_DEPTH:
        raise WireError("nested too deeply")
    t = type(value)
    if t in _SCALARS:
        return value
    if t is list:
        return [encode(v, _depth + 1) for v in value]
    if t is tuple or t is set or t is frozenset:
        items = [encode(v, _depth + 1) for v in value]
        return {t.__name__: items}
    if t is dict:
        return {"dict": [[encode(k, _depth + 1), encode(v, _depth + 1)] for k, v in value.items()]}
    if t is bytes:
        return {"bytes": value.hex()}
    if t is complex:
        return {"complex": [value.real, value.imag]}
    raise WireError(f"values of type {t.__name__} are not plain data")


def dumps(value: Any) -> str:
    """One line of ASCII JSON for ``value`` (lone surrogates are escaped). Raises WireError."""
    try:
        return json.dumps(encode(value), ensure_ascii=True, separators=(",", ":"))
    except RecursionError as e:
        raise WireError("nested too deeply") from e


def loads(text: str) -> Any:
    """The value encoded in ``text`` (fresh builtin objects). Raises WireError for anything
    that is not valid wire format or exceeds the limits."""
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise WireError(f"not JSON: {type(e).__name__}") from e
    return decode(doc)


def decode(doc: Any) -> Any:
    """Build the value that a parsed JSON document encodes. Raises WireError."""
    budget = [MAX_NODES]
    return _decode(doc, 0, budget)


def _decode(doc: Any, depth: int, budget: list[int]) -> Any:
    if depth > MAX_DEPTH:
        raise WireError("nested too deeply")
    budget[0] -= 1
    if budget[0] < 0:
        raise WireError("too many values")
    t = type(doc)
    if t in _SCALARS:
        return doc
    if t is list:
        return [_decode(v, depth + 1, budget) for v in doc]
    if t is not dict or len(doc) != 1:
        raise WireError("a tagged value must be an object with one key")
    ((tag, body),) = doc.items()
    try:
        if tag in ("tuple", "set", "frozenset") and type(body) is list:
            items = [_decode(v, depth + 1, budget) for v in body]
            return {"tuple": tuple, "set": set, "frozenset": frozenset}[tag](items)
        if tag == "dict" and type(body) is list:
            out = {}
            for pair in body:
                if type(pair) is not list or len(pair) != 2:
                    raise WireError("a dict entry must be a [key, value] pair")
                out[_decode(pair[0], depth + 1, budget)] = _decode(pair[1], depth + 1, budget)
            return out
        if tag == "bytes" and type(body) is str:
            return bytes.fromhex(body)
        if tag == "complex" and type(body) is list and len(body) == 2:
            if all(type(x) in (int, float) for x in body):
                return complex(body[0], body[1])
    except TypeError as e:  # an unhashable set member or dict key
        raise WireError(f"bad {tag}: {e}") from e
    except (ValueError, OverflowError) as e:  # bad hex; a complex part too large for a float
        raise WireError(f"bad {tag}: {e}") from e
    raise WireError(f"unknown or malformed tag {tag!r}" if tag in _TAGGED else "unknown tag")
