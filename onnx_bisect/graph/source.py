"""Where a node comes from in the exporter's source: the module path, its class, and the file
and line of the forward that made it, read from what exporters leave in the model (pure).

torch's dynamo exporter writes on every node ``pkg.torch.onnx.name_scopes`` (``['',
'blocks.0', 'blocks.0.act', 'gelu']``: the module path, then the op), ``class_hierarchy``
(the class of each scope) and ``stack_trace`` (the frames of the forward calls, outermost
first). The TorchScript exporter names nodes after their scopes (``/model.22/dfl/conv/Conv``,
``/blocks/blocks.0/act/Gelu``), which gives the module path alone.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import onnx

__all__ = ["SourceInfo", "node_source", "shown_source", "source_lines"]

SCOPES = "pkg.torch.onnx.name_scopes"
CLASSES = "pkg.torch.onnx.class_hierarchy"
STACK = "pkg.torch.onnx.stack_trace"
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)\s*$')
# torch's own modules: a frame in them is how torch runs a module, not where the user's
# forward made the op (a frame in transformers' modeling code is the model's source).
_TORCH_OWN = re.compile(r"[/\\]torch[/\\](nn|_dynamo|fx|onnx|export|_export|utils)[/\\]")


@dataclass(frozen=True)
class SourceInfo:
    """A node's origin: the module path (``blocks.0.act``; "" for the top module), the
    module's class, and the innermost frame of the user's code (file, line, its code)."""

    module: str
    class_name: str = ""
    file: str = ""
    line: int | None = None
    code: str = ""

    @property
    def beyond_name(self) -> bool:
        """Whether it says more than a scoped node name does (``/blocks/blocks.0/act/Gelu``
        already reads as its module path)."""
        return bool(self.class_name or self.file)

    def describe(self) -> str:
        """``module blocks.0.act (GELU) at model.py:6: return s.act(s.fc(x)) + x``."""
        said = f"module {self.module or '(top)'}"
        if self.class_name:
            said += f" ({self.class_name.rsplit('.', 1)[-1]})"
        if self.file:
            said += f" at {self.file}:{self.line}"
            if self.code:
                said += f": {self.code}"
        return said


def node_source(node: onnx.NodeProto) -> SourceInfo | None:
    """The node's origin, from the dynamo exporter's metadata, else from a TorchScript
    export's scoped node name; None where the model says nothing of it."""
    meta = {p.key: p.value for p in node.metadata_props}
    if SCOPES in meta:
        scopes = _list(meta[SCOPES])
        if len(scopes) >= 2:
            classes = _list(meta.get(CLASSES, "[]"))
            module = scopes[-2]
            cls = classes[-2] if len(classes) == len(scopes) else ""
            file, line, code = _frame(meta.get(STACK, ""))
            return SourceInfo(module, cls, file, line, code)
    return _scoped_name(node.name)


def _list(text: str) -> list[str]:
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return []
    return [str(v) for v in value] if isinstance(value, list | tuple) else []


def _frame(trace: str) -> tuple[str, int | None, str]:
    """The innermost frame outside torch's own modules: where the user's forward made it."""
    lines = trace.splitlines()
    found: tuple[str, int | None, str] = ("", None, "")
    for i, text in enumerate(lines):
        m = _FRAME.match(text)
        if m is None or _TORCH_OWN.search(m["file"]):
            continue
        code = lines[i + 1].strip() if i + 1 < len(lines) and not _FRAME.match(lines[i + 1]) else ""
        found = (m["file"], int(m["line"]), code)
    return found


def _scoped_name(name: str) -> SourceInfo | None:
    """``/blocks/blocks.0/act/Gelu`` -> ``blocks.0.act``: a container's child repeats its
    parent's name (``blocks.0`` under ``blocks``), an attribute does not (``act``)."""
    if not name.startswith("/") or name.count("/") < 2:
        return None
    parts: list[str] = []
    for comp in name.strip("/").split("/")[:-1]:
        if parts and comp.startswith(parts[-1] + "."):
            parts[-1] = comp
        else:
            parts.append(comp)
    return SourceInfo(".".join(parts)) if parts else None


def shown_source(sources: Mapping[str, SourceInfo], name: str) -> str | None:
    """Where node ``name`` comes from, where that says more than its name (report.json has
    the module path of a scoped name too)."""
    src = sources.get(name)
    return src.describe() if src is not None and src.beyond_name else None


def source_lines(sources: Mapping[str, SourceInfo], nodes: Sequence[str]) -> list[str]:
    """Where ``nodes`` come from, a line per module (three at most), for the root cause."""
    shown = (shown_source(sources, name) for name in nodes)
    return list(dict.fromkeys(s for s in shown if s is not None))[:3]
