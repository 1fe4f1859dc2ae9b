"""The operator table: which ONNX operator versions the torch backend implements, and how.

An implementation registers for a range of the operator's *schema* versions (the
``since_version`` values of ``onnx.defs``), not of model opsets: a model at opset 17 uses
``Softmax``-13, and a handler written for Softmax-13 says ``since=13``. A version past the
newest one a handler names is not assumed to mean the same thing; it is unsupported until
someone checks it against ONNX's node tests (``docs/torch-ops.md``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import onnx

from onnx_bisect.errors import BackendError

if TYPE_CHECKING:
    import torch

    from onnx_bisect.backends.torch.context import OpContext

__all__ = ["OpFn", "UnsupportedOperator", "Entry", "lookup", "register", "schema_version", "table"]

# One call per node: the context, the inputs in order (None for an omitted optional input),
# the attributes by name. Returns one tensor or the outputs in order (None for one not produced).
OpFn = Callable[
    ["OpContext", "list[torch.Tensor | None]", "dict[str, Any]"],
    "torch.Tensor | Sequence[torch.Tensor | None]",
]


class UnsupportedOperator(BackendError):
    """The torch backend has no implementation of this operator version.

    The message carries "is not supported", which isolation reads as an unsupported node,
    not a failed one."""


@dataclass(frozen=True)
class Entry:
    op_type: str
    domain: str
    since: int
    until: int | None  # newest schema version this implementation was checked against
    fn: OpFn


_TABLE: dict[tuple[str, str], list[Entry]] = {}


def register(
    op_type: str, *, since: int = 1, until: int | None = None, domain: str = ""
) -> Callable[[OpFn], OpFn]:
    """Register ``fn`` for schema versions ``since..until`` (inclusive; None: every later one)."""

    def wrap(fn: OpFn) -> OpFn:
        entries = _TABLE.setdefault((domain, op_type), [])
        entries.append(Entry(op_type, domain, since, until, fn))
        entries.sort(key=lambda e: -e.since)
        return fn

    return wrap


@functools.cache  # onnx's schema lookup is the costliest part of binding a node
def schema_version(op_type: str, opset: int, domain: str = "") -> int:
    """The ``since_version`` of the schema a model at ``opset`` uses for ``op_type``."""
    try:
        return int(onnx.defs.get_schema(op_type, opset, domain).since_version)
    except onnx.defs.SchemaError:
        return opset  # a custom domain without schemas: versions are the domain's opset


def lookup(op_type: str, opset: int, domain: str = "") -> OpFn:
    version = schema_version(op_type, opset, domain)
    for entry in _TABLE.get((domain, op_type), ()):
        if entry.since <= version and (entry.until is None or version <= entry.until):
            return entry.fn
    where = f"{domain}." if domain else ""
    raise UnsupportedOperator(
        f"the torch backend does not support {where}{op_type} version {version} "
        f"(model opset {opset}); docs/torch-ops.md lists the supported operators"
    )


def table() -> dict[tuple[str, str], list[Entry]]:
    """Every registered implementation, for coverage reports."""
    return {k: list(v) for k, v in _TABLE.items()}
