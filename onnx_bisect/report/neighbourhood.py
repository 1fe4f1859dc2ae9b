"""The root cause's neighbourhood and the amplification chain, drawn as a small SVG graph.

A few dozen boxes in layers do not need a graph-layout library: columns follow the longest
path from the left (edges run forward in topological order), boxes in a column follow the
topological index. Edges come from the node results' own tensor names, so no model is loaded.
Colours are CSS classes (``v-<verdict>``) that the page styles, one palette for graph and table.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from html import escape
from typing import TYPE_CHECKING

from onnx_bisect.report.format import fmt_error
from onnx_bisect.result import chain_positions

if TYPE_CHECKING:
    from onnx_bisect.result import BisectResult, NodeResult

__all__ = ["MAX_NODES", "Neighbourhood", "neighbourhood", "neighbourhood_svg"]

MAX_NODES = 25
_CHAIN_HEAD = 8  # chain links kept from the root cause on; then the largest gains and the end
_BOX_W, _BOX_H, _GAP_X, _GAP_Y, _PAD = 168, 46, 44, 14, 10
_ARC = 34  # room above the boxes for edges that jump over a column


@dataclass(frozen=True)
class Neighbourhood:
    """The nodes to draw (topological order), the tensor edges between them, and the chain's
    steps over nodes left out (``skipped`` counts them)."""

    nodes: tuple[NodeResult, ...]
    edges: tuple[tuple[int, int], ...]  # producer index -> consumer index
    skipped: tuple[tuple[int, int, int], ...]  # chain link -> next kept link, nodes between
    centre: frozenset[int]
    chain_steps: frozenset[tuple[int, int]]  # consecutive links of the whole chain


def neighbourhood(result: BisectResult, hops: int = 3) -> Neighbourhood | None:
    """The root cause (else the first divergence), its producers and consumers up to ``hops``
    away, and the amplification chain, at most ``MAX_NODES`` nodes; None with nothing to show."""
    by_index = {n.index: n for n in result.nodes}
    by_name = {n.name: n.index for n in result.nodes}
    rc = result.root_cause
    centre = [by_name[n] for n in (rc.nodes if rc else ()) if n in by_name]
    if not centre and result.first_divergence is not None:
        centre = [result.first_divergence.index]
    if not centre:
        return None
    producers, consumers = _edges(result.nodes)
    kept = [c for c in result.chain if c.index in by_index]
    chain = [c.index for c in kept]
    kept_chain = _kept_chain(result, chain)
    picked: list[int] = list(dict.fromkeys(centre + kept_chain))
    ring = set(centre)
    for _ in range(hops):
        ring = {m for i in ring for m in (*producers.get(i, ()), *consumers.get(i, ()))}
        for m in sorted(ring, key=lambda m: abs(m - centre[0])):
            if len(picked) >= MAX_NODES:
                break
            if m not in picked:
                picked.append(m)
    chosen = sorted(set(picked[:MAX_NODES]))
    inside = set(chosen)
    edges = tuple((u, v) for v in chosen for u in producers.get(v, ()) if u in inside)
    drawn = [i for i in chain if i in inside]  # the rings may have picked links, too
    at = dict(zip(chain, chain_positions(kept), strict=True))  # in the whole, folded chain
    skipped = tuple(
        (a, b, at[b] - at[a] - 1)
        for a, b in zip(drawn, drawn[1:], strict=False)
        if (a, b) not in edges
    )
    steps = frozenset(zip(chain, chain[1:], strict=False))
    return Neighbourhood(
        tuple(by_index[i] for i in chosen), edges, skipped, frozenset(centre), steps
    )


def _edges(nodes: Sequence[NodeResult]) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    made_by = {t: n.index for n in nodes for t in n.outputs if t}
    producers: dict[int, list[int]] = {}
    consumers: dict[int, list[int]] = {}
    for n in nodes:
        for t in dict.fromkeys(n.inputs):
            if t in made_by and made_by[t] != n.index:
                producers.setdefault(n.index, []).append(made_by[t])
                consumers.setdefault(made_by[t], []).append(n.index)
    return producers, consumers


def _kept_chain(result: BisectResult, chain: list[int]) -> list[int]:
    """The whole chain when short; else its head, its three largest gains and its last link."""
    if len(chain) <= _CHAIN_HEAD + 4:
        return chain
    gains = sorted(result.chain[_CHAIN_HEAD:-1], key=lambda c: -(c.gain or 0.0))[:3]
    return sorted({*chain[:_CHAIN_HEAD], *(c.index for c in gains), chain[-1]})


def neighbourhood_svg(hood: Neighbourhood, criterion_key: str) -> str:
    """The graph as an inline ``<svg>``: one box per node (op type, short name, accumulated
    error; the full name and numbers in its tooltip), arrows along tensors, dashed arrows over
    chain links left out."""
    layer: dict[int, int] = {}
    preds: dict[int, list[int]] = {}
    for u, v in hood.edges:
        preds.setdefault(v, []).append(u)
    for a, b, _ in hood.skipped:
        preds.setdefault(b, []).append(a)
    for n in hood.nodes:  # topological order: every predecessor is placed first
        layer[n.index] = max((layer[p] + 1 for p in preds.get(n.index, ())), default=0)
    columns: dict[int, list[int]] = {}
    for n in hood.nodes:
        columns.setdefault(layer[n.index], []).append(n.index)
    jumps = any(layer[v] - layer[u] > 1 for u, v in hood.edges)
    top = _PAD + (_ARC if jumps else 0)
    pos = {
        i: (_PAD + col * (_BOX_W + _GAP_X), top + row * (_BOX_H + _GAP_Y))
        for col, members in columns.items()
        for row, i in enumerate(members)
    }
    width = _PAD * 2 + len(columns) * (_BOX_W + _GAP_X) - _GAP_X
    height = top + _PAD + max(len(m) for m in columns.values()) * (_BOX_H + _GAP_Y) - _GAP_Y
    parts = [
        f'<svg class="graph" width="{width}" '
        f'height="{height}" viewBox="0 0 {width} {height}" role="img" '
        'aria-label="root cause neighbourhood and amplification chain">',
        # userSpaceOnUse: the same arrowhead on a thick chain edge as on a thin one.
        '<defs><marker id="arrow" viewBox="0 0 8 8" refX="8" refY="4" markerWidth="8" '
        'markerHeight="8" markerUnits="userSpaceOnUse" orient="auto">'
        '<path d="M0,0 L8,4 L0,8 z" fill="#666"/></marker></defs>',
    ]
    for u, v in hood.edges:
        cls = "edge chain" if (u, v) in hood.chain_steps else "edge"
        parts.append(_arrow(pos[u], pos[v], cls, "", jump=layer[v] - layer[u] > 1))
    for a, b, count in hood.skipped:
        title = f"{count} more on the chain"
        parts.append(_arrow(pos[a], pos[b], "edge chain skipped", title, jump=False))
    for n in hood.nodes:
        parts.append(_box(n, pos[n.index], n.index in hood.centre, criterion_key))
    parts.append("</svg>")
    return "\n".join(parts)


def _arrow(a: tuple[int, int], b: tuple[int, int], cls: str, title: str, *, jump: bool) -> str:
    """Side to side between neighbouring columns; an edge over a column arches above the boxes
    (top to top), else it would run behind the boxes between."""
    tip = f"<title>{escape(title)}</title>" if title else ""
    if jump:
        x1, y1, x2, y2 = a[0] + _BOX_W * 3 // 4, a[1], b[0] + _BOX_W // 4, b[1]
        lift = min(y1, y2) - _ARC + 4
        d = f"M{x1},{y1} C{x1},{lift} {x2},{lift} {x2},{y2}"
    else:
        x1, y1 = a[0] + _BOX_W, a[1] + _BOX_H // 2
        x2, y2 = b[0], b[1] + _BOX_H // 2
        mid = (x1 + x2) // 2
        d = f"M{x1},{y1} C{mid},{y1} {mid},{y2} {x2},{y2}"
    return f'<path class="{cls}" d="{d}" marker-end="url(#arrow)">{tip}</path>'


def _box(n: NodeResult, at: tuple[int, int], centre: bool, key: str) -> str:
    x, y = at
    name = n.name if len(n.name) <= 26 else "…" + n.name[-25:]
    tip = (
        f"#{n.index} {n.op_type} {n.name}\nverdict: {n.verdict.value}\n"
        f"accumulated {key}: {fmt_error(n.accumulated, key)}\n"
        f"isolated {key}: {fmt_error(n.isolated, key)}"
    )
    cls = f"node v-{n.verdict.value}" + (" centre" if centre else "")
    return (
        f'<g class="{cls}" transform="translate({x},{y})"><title>{escape(tip)}</title>'
        f'<rect width="{_BOX_W}" height="{_BOX_H}" rx="5"/>'
        f'<text x="8" y="15" class="op">{escape(n.op_type)} #{n.index}</text>'
        f'<text x="8" y="28" class="name">{escape(name)}</text>'
        f'<text x="8" y="40" class="err">{escape(n.verdict.value)} · '
        f"{fmt_error(n.accumulated, key)}</text></g>"
    )
