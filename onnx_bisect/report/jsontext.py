"""JSON text for report files: readable at the top, one line per row below, written by the C
encoder.

``json.dumps(indent=...)`` runs the pure-Python encoder (CPython uses its C encoder only
without ``indent``): a 20,000-node report.json took 8 s that way. Here only the outer
``expand`` levels get a line per entry, and everything deeper (one node's record, say) is one
compact line from the C encoder, so the file stays easy to read and grep while its cost is
that of ``json.dumps`` without indent.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

__all__ = ["json_text"]


def json_text(value: Any, *, expand: int = 2, indent: int = 2) -> str:
    """``value`` as JSON (NaN and infinities refused), containers in the outer ``expand``
    levels one entry per line, ends with a newline."""
    return "".join(_chunks(value, expand, indent, 0)) + "\n"


def _chunks(value: Any, expand: int, indent: int, depth: int) -> Iterator[str]:
    if depth >= expand or not isinstance(value, dict | list) or not value:
        yield json.dumps(value, allow_nan=False)
        return
    inner = "\n" + " " * (indent * (depth + 1))
    items: Any = value.items() if isinstance(value, dict) else ((None, v) for v in value)
    yield "{" if isinstance(value, dict) else "["
    for i, (key, item) in enumerate(items):
        yield ("," if i else "") + inner
        if key is not None:
            yield json.dumps(str(key)) + ": "
        yield from _chunks(item, expand, indent, depth + 1)
    yield "\n" + " " * (indent * depth) + ("}" if isinstance(value, dict) else "]")
