"""A Mermaid flowchart of the root cause's neighbourhood and the amplification chain.

GitHub renders a ```` ```mermaid ```` block in an issue or a Markdown file as a diagram, so the
report shows where the error starts and how it travels without a screenshot. Node ids are
``n{index}`` (graph names hold ``/``, ``.`` and ``:``, which Mermaid ids cannot); names go in
quoted labels, with Mermaid's entity codes for the characters a label cannot hold.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from onnx_bisect.report.escape import one_line
from onnx_bisect.result import chain_positions
from onnx_bisect.text import fmt, plural

if TYPE_CHECKING:
    from onnx_bisect.result import BisectResult, ChainLink, NodeResult

__all__ = ["focus_node", "mermaid_lines"]

# Chain links drawn: the first from the root cause on, the last ones, and the largest gains.
CHAIN_HEAD, CHAIN_TAIL, CHAIN_GAINS = 4, 2, 3
_NAME_CHARS = 40
_STYLES = {
    "culprit": "fill:#f8d7da,stroke:#b02a37,stroke-width:2px",
    "propagated": "fill:#fff3cd,stroke:#997404",
    "ok": "fill:#d1e7dd,stroke:#146c43",
    "other": "fill:#e2e3e5,stroke:#41464b",
}
# A backtick opens Mermaid's Markdown strings (and three would end the fenced block).
_ESCAPES = {"&": "#amp;", '"': "#quot;", "<": "#lt;", ">": "#gt;", "#": "#35;", "`": "#96;"}


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
    chain = [c for c in result.chain if c.node in by_name]
    picked = _chain_positions(chain)
    at = chain_positions(chain)  # in the whole chain, the folded links counted
    drawn = [(i, by_name[chain[i].node]) for i in picked]
    for _, n in drawn:
        shown.setdefault(n.name, n)
    nodes = sorted(shown.values(), key=lambda n: n.index)
    key = result.criterion.key
    lines = ["```mermaid", "flowchart LR"]
    gain = {c.node: c.gain for c in chain}
    lines += [f'  n{n.index}["{_label(n, key, gain.get(n.name))}"]' for n in nodes]
    edges = {
        (a.index, b.index)
        for a in nodes
        for b in nodes
        if a is not b and set(a.outputs) & set(b.inputs)
    }
    lines += [f"  n{a} --> n{b}" for a, b in sorted(edges)]
    # Chain links drawn apart, with the links between them left out: a dotted hop.
    for (i, a), (j, b) in zip(drawn, drawn[1:], strict=False):
        if (a.index, b.index) not in edges:
            gap = at[j] - at[i] - 1
            between = f'|"{plural(gap, "node")}"|' if gap else ""
            lines.append(f"  n{a.index} -.->{between} n{b.index}")
    used = {_style(n) for n in nodes}
    lines += [f"  classDef {c} {s}" for c, s in _STYLES.items() if c in used]
    for c in sorted(used):
        ids = ",".join(f"n{n.index}" for n in nodes if _style(n) == c)
        lines.append(f"  class {ids} {c}")
    return [*lines, "```"]


def _chain_positions(chain: Sequence[ChainLink]) -> list[int]:
    """The links drawn: the first few from the root cause, the last, and the largest gains."""
    if len(chain) <= CHAIN_HEAD + CHAIN_TAIL + CHAIN_GAINS:
        return list(range(len(chain)))
    gains = sorted(
        (i for i, c in enumerate(chain) if (c.gain or 0) > 1), key=lambda i: -(chain[i].gain or 0)
    )
    ends = {*range(CHAIN_HEAD), *range(len(chain) - CHAIN_TAIL, len(chain))}
    return sorted(ends | set(gains[:CHAIN_GAINS]))


def _style(n: NodeResult) -> str:
    v = n.verdict.value
    return v if v in _STYLES else "other"


def _label(n: NodeResult, key: str, gain: float | None) -> str:
    full = one_line(n.name)
    name = full if len(full) <= _NAME_CHARS else "…" + full[-(_NAME_CHARS - 1) :]
    error = f"<br/>{key} {n.accumulated.shown(key)}" if n.accumulated is not None else ""
    grew = f", gain ×{fmt(gain)}" if gain is not None else ""
    return f"{_escape(n.op_type)} {_escape(name)}{error}<br/>{n.verdict.value}{grew}"


def _escape(text: str) -> str:
    """A label's text, on one line (a newline ends a Mermaid statement), with entity codes
    for the characters a quoted label cannot hold."""
    return "".join(_ESCAPES.get(c, c) for c in one_line(text))
