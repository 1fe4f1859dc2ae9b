"""Control flow: If, Loop and Scan, running their subgraphs through the interpreter.

Conditions and trip counts are read back to Python (one device sync per decision): the
interpreter is eager, so the branch taken must be known before it runs. Values may be
sequences (ops/sequence.py) or empty optionals (None) where the graph carries them.
"""

from __future__ import annotations

from typing import Any

import onnx
import torch

from onnx_bisect.backends.torch.context import OpContext
from onnx_bisect.backends.torch.ops.registry import register
from onnx_bisect.errors import BackendError

__all__: list[str] = []


def _flag(t: torch.Tensor) -> bool:
    if t.numel() != 1:
        raise BackendError(f"a condition must have one element, not shape {tuple(t.shape)}")
    return bool(t.reshape(()).item())


def _stack(
    ctx: OpContext, graph: onnx.GraphProto, k: int, parts: list[torch.Tensor], axis: int = 0
) -> torch.Tensor:
    """Scan output ``k`` (the graph's output ``k``) stacked along a new ``axis``; with no
    iteration its shape comes from the subgraph's declared output type."""
    if parts:
        rank = parts[0].ndim + 1
        return torch.stack(parts, dim=axis + rank if axis < 0 else axis)
    ttype = graph.output[k].type.tensor_type
    dims = [d.dim_value if d.HasField("dim_value") else -1 for d in ttype.shape.dim]
    if not ttype.HasField("shape") or -1 in dims:
        raise BackendError(
            "a scan output of zero iterations whose element shape is not declared is not supported"
        )
    shape = list(dims)
    shape.insert(axis + len(dims) + 1 if axis < 0 else axis, 0)
    return torch.empty(shape, dtype=ctx.dtype(ttype.elem_type), device=ctx.device)


@register("If", since=1, until=25)
def if_(
    ctx: OpContext, x: list[torch.Tensor | None], attrs: dict[str, Any]
) -> list[torch.Tensor | None]:
    cond = x[0]
    assert cond is not None
    branch = attrs["then_branch"] if _flag(cond) else attrs["else_branch"]
    return ctx.run_graph(branch, [])


def _present(values: list[torch.Tensor | None], what: str) -> list[torch.Tensor]:
    out = []
    for v in values:
        if v is None:
            raise BackendError(f"an omitted (optional) {what} is not supported")
        out.append(v)
    return out


@register("Loop", since=1, until=25)
def loop(ctx: OpContext, x: list[torch.Tensor | None], attrs: dict[str, Any]) -> list[torch.Tensor]:
    body: onnx.GraphProto = attrs["body"]
    trip, cond = x[0], x[1] if len(x) > 1 else None
    carried = _present(list(x[2:]), "loop-carried value")
    limit = None if trip is None else int(trip.reshape(-1)[0].item())
    keep = True if cond is None else _flag(cond)
    flag = cond if cond is not None else torch.ones((), dtype=torch.bool, device=ctx.device)
    n = len(carried)
    scans: list[list[torch.Tensor]] = [[] for _ in range(len(body.output) - 1 - n)]
    i = 0
    while keep and (limit is None or i < limit):
        step = torch.tensor(i, dtype=torch.int64, device=ctx.device)
        out = _present(ctx.run_graph(body, [step, flag, *carried]), "Loop body output")
        carried = out[1 : 1 + n]
        for parts, value in zip(scans, out[1 + n :], strict=True):
            parts.append(value)
        # ONNX says a for loop (no condition input) ignores the body's condition; onnxruntime
        # and ONNX's reference stop on it anyway, and so do we.
        flag = out[0]
        keep = _flag(flag)
        i += 1
    stacked = [_stack(ctx, body, 1 + n + k, parts) for k, parts in enumerate(scans)]
    return [*carried, *stacked]


def _axes(attrs: dict[str, Any], name: str, count: int) -> list[int]:
    values = [int(v) for v in attrs.get(name, [0] * count)]
    if len(values) != count:
        raise BackendError(f"Scan {name} has {len(values)} entries, {count} expected")
    return values


@register("Scan", since=9, until=25)
def scan(ctx: OpContext, x: list[torch.Tensor | None], attrs: dict[str, Any]) -> list[torch.Tensor]:
    body: onnx.GraphProto = attrs["body"]
    m = int(attrs["num_scan_inputs"])
    values = _present(x, "Scan input")
    n = len(values) - m
    states, inputs = values[:n], values[n:]
    k = len(body.output) - n
    in_axes = [
        a + t.ndim if a < 0 else a
        for a, t in zip(_axes(attrs, "scan_input_axes", m), inputs, strict=True)
    ]
    in_dirs = _axes(attrs, "scan_input_directions", m)
    out_axes = _axes(attrs, "scan_output_axes", k)
    out_dirs = _axes(attrs, "scan_output_directions", k)
    lengths = {t.shape[a] for t, a in zip(inputs, in_axes, strict=True)}
    if len(lengths) > 1:
        raise BackendError(f"Scan inputs have different sequence lengths {sorted(lengths)}")
    steps = lengths.pop() if lengths else 0
    scans: list[list[torch.Tensor]] = [[] for _ in range(k)]
    for t in range(steps):
        slices = [
            s.select(a, steps - 1 - t if d else t)
            for s, a, d in zip(inputs, in_axes, in_dirs, strict=True)
        ]
        out = _present(ctx.run_graph(body, [*states, *slices]), "Scan body output")
        states = out[:n]
        for parts, value in zip(scans, out[n:], strict=True):
            parts.append(value)
    stacked = []
    for j, parts in enumerate(scans):
        # A reverse scan output is built by prepending: its first element is the last step's.
        ordered = parts[::-1] if out_dirs[j] else parts
        stacked.append(_stack(ctx, body, n + j, ordered, out_axes[j]))
    return [*states, *stacked]


@register("Scan", since=8, until=8)
def scan_8(
    ctx: OpContext, x: list[torch.Tensor | None], attrs: dict[str, Any]
) -> list[torch.Tensor]:
    """Scan-8: every state and input has a leading batch axis (the scan axis is the next
    one) and the first input holds optional per-batch lengths; each batch entry is a Scan-9
    run of its own."""
    lengths, values = x[0], _present(x[1:], "Scan input")
    m = int(attrs["num_scan_inputs"])
    inner = {
        "body": attrs["body"],
        "num_scan_inputs": m,
        "scan_input_directions": attrs.get("directions", [0] * m),
    }
    runs: list[list[torch.Tensor]] = []
    for b in range(values[0].shape[0]):
        sliced: list[torch.Tensor] = [v[b] for v in values]
        if lengths is not None:
            count = int(lengths.reshape(-1)[b])
            sliced[len(sliced) - m :] = [s[:count] for s in sliced[len(sliced) - m :]]
        out = scan(ctx, [*sliced], inner)
        assert not isinstance(out, torch.Tensor)
        runs.append(_present(list(out), "Scan output"))
    return [torch.stack([run[i] for run in runs]) for i in range(len(runs[0]))]
