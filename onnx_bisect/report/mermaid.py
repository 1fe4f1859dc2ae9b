"""A Mermaid flowchart of the root cause's neighbourhood and the amplification chain.

GitHub renders a ```` ```mermaid ```` block in an issue or a Markdown file as a diagram, so the
report shows where the error starts and how it travels without a screenshot. Node ids are
``n{index}`` (graph names hold ``/``, ``.`` and ``:``, which Mermaid ids cannot); names go in
quoted labels, with Mermaid's entity codes for the characters a label cannot hold.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from onnx_bisect.text import fmt, plural

if TYPE_CHECKING:
    from onnx_bisect.result import BisectResult, NodeResult

__all__ = ["focus_node", "mermaid_lines"]

CHAIN_HEAD = 5  # chain links drawn from the root cause on; the rest are elided to the last
CHAIN_TAIL = 2
_NAME_CHARS = 40
_STYLES = {
    "culprit": "fill:#f8d7da,stroke:#b02a37,stroke-width:2px",
    "propagated": "fill:#fff3cd,stroke:#997404",
    "ok": "fill:#d1e7dd,stroke:#146c43",
    "other": "fill:#e2e3e5,stroke:#41464b",
}
_ESCAPES = {"&": "#amp;", '"': "#quot;", "<": "#lt;", ">": "#gt;", "#": "#35;"}


def focus_node(result: BisectResult) -> NodeResult | None:
    """The node the report centres on: the root cause's first node, else the first divergence."""
    by_name = {n.name: n for n in result.nodes}
    rc = result.root_cause
    for name in rc.nodes if rc is not None else ():
        if name in by_name:
            return by_name[name]
    fd = result.first_divergence
    return by_name.get(fd.name) if fd is not None else None


def mermaid_lines(result: BisectResult) -> list[str]:
    """The fenced ```` ```mermaid ```` block, or nothing when there is no node to centre on."""
    focus = focus_node(result)
    if focus is None:
        return []
    by_name = {n.name: n for n in result.nodes}
    producer = {t: n for n in result.nodes for t in n.outputs}
    shown: dict[str, NodeResult] = {focus.name: focus}
    for t in focus.inputs:
        if t in producer:
            shown.setdefault(producer[t].name, producer[t])
    outs = set(focus.outputs)
    for n in result.nodes:
        if outs & set(n.inputs):
            shown.setdefault(n.name, n)
    fd = result.first_divergence
    if fd is not None and fd.name in by_name:
        shown.setdefault(fd.name, by_name[fd.name])
    chain = [by_name[c.node] for c in result.chain if c.node in by_name]
    elided = 0
    if len(chain) > CHAIN_HEAD + CHAIN_TAIL + 1:
        elided = len(chain) - CHAIN_HEAD - CHAIN_TAIL
        drawn = chain[:CHAIN_HEAD] + chain[-CHAIN_TAIL:]
    else:
        drawn = chain
    for n in drawn:
        shown.setdefault(n.name, n)
    nodes = sorted(shown.values(), key=lambda n: n.index)
    key = result.criterion.key
    lines = ["```mermaid", "flowchart LR"]
    lines += [f'  n{n.index}["{_label(n, key)}"]' for n in nodes]
    edges = {
        (a.index, b.index)
        for a in nodes
        for b in nodes
        if a is not b and set(a.outputs) & set(b.inputs)
    }
    lines += [f"  n{a} --> n{b}" for a, b in sorted(edges)]
    # Consecutive chain links that are not drawn next to each other: a dotted hop.
    for a, b in zip(drawn, drawn[1:], strict=False):
        if (a.index, b.index) not in edges:
            between = f'|"{plural(elided, "node")}"|' if elided and b is drawn[CHAIN_HEAD] else ""
            lines.append(f"  n{a.index} -.->{between} n{b.index}")
    used = {_style(n) for n in nodes}
    lines += [f"  classDef {c} {s}" for c, s in _STYLES.items() if c in used]
    for c in sorted(used):
        ids = ",".join(f"n{n.index}" for n in nodes if _style(n) == c)
        lines.append(f"  class {ids} {c}")
    return [*lines, "```"]


def _style(n: NodeResult) -> str:
    v = n.verdict.value
    return v if v in _STYLES else "other"


def _label(n: NodeResult, key: str) -> str:
    name = n.name if len(n.name) <= _NAME_CHARS else "…" + n.name[-(_NAME_CHARS - 1) :]
    error = f"<br/>{key} {fmt(n.accumulated_error)}" if n.accumulated is not None else ""
    return f"{n.op_type} {_escape(name)}{error}<br/>{n.verdict.value}"


def _escape(text: str) -> str:
    return "".join(_ESCAPES.get(c, c) for c in text)
