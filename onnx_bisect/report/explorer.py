"""Model Explorer overlays: the accumulated and isolated errors as node data on the model.

Model Explorer (``ai-edge-model-explorer`` with the ``model-explorer-onnx`` adapter) colours a
graph's nodes from a JSON file ``{graph id: {"results": {node id: {"value": x}}, ...}}``. The
keys have to be the ids the adapter gives, which are not always the names our reports use:

- the main graph's id is ``graph.name``;
- an If's branch nodes are drawn in the main graph as ``{if}/{then_branch|else_branch}/{node}``
  (our inlined branch keeps ``{node}``, or that prefixed name where it clashed);
- a Loop's or Scan's body is its own graph ``{loop}/body``, where our unrolled iterations
  ``{loop}/iteration_{i}/{node}`` all land on ``{node}`` (the worst iteration is shown);
- the adapter names unnamed nodes ``node``, ``node_1``… over the whole model, where we use
  ``{op_type}_{i}``, and calls a graph without a name "". A model with unnamed nodes (or no
  graph name) is therefore copied, with our names and ``<main>``, to
  ``explorer/model.onnx``, and the overlays are keyed on that copy.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import onnx

from onnx_bisect.graph.load import name_nodes
from onnx_bisect.report.jsontext import json_text

if TYPE_CHECKING:
    from onnx_bisect.compare.criterion import Comparison
    from onnx_bisect.result import BisectResult, NodeResult

__all__ = [
    "EXPLORER_DIR",
    "OVERLAYS",
    "ExplorerFiles",
    "explorer_model",
    "overlay",
    "read_explorer",
    "write_explorer",
]

EXPLORER_DIR = "explorer"
# The adapter's name for a graph without one; it reads a protobuf's empty name as "" though,
# so the copy is given this name explicitly.
MAIN_GRAPH = "<main>"
_OK, _BAD = "#a5d6a7", "#ef9a9a"  # green at or under the threshold, red over it
# JSON has no infinity; the top threshold has to bound every value.
_TOP = sys.float_info.max
_ABOVE = {"value": _TOP, "bgColor": _BAD}
_ITERATION = re.compile(r"^(?P<loop>.+)/iteration_\d+/(?P<node>.+)$")


@dataclass(frozen=True)
class Overlay:
    """One node-data file: its file name, the name Model Explorer shows, and the error it
    reads off a node row."""

    file: str
    title: str
    comparison: Callable[[NodeResult], Comparison | None]


OVERLAYS = (
    Overlay("accumulated.json", "accumulated error", lambda n: n.accumulated),
    Overlay("isolated.json", "isolated error", lambda n: n.isolated),
)


@dataclass(frozen=True)
class ExplorerFiles:
    """What ``onnx-bisect view`` opens: the model and the overlays on it."""

    model: Path
    overlays: tuple[Path, ...]

    def command(self) -> list[str]:
        """The ``model-explorer`` command line that shows them."""
        return [
            "model-explorer",
            str(self.model),
            "--extensions=model_explorer_onnx",
            "--node_data_paths=" + ",".join(str(p) for p in self.overlays),
        ]


def explorer_model(model: onnx.ModelProto) -> tuple[onnx.ModelProto, bool]:
    """``model`` as Model Explorer should be shown it, and whether that differs from the file:
    every node named as our reports name it, and the graph named."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    graph = copy.graph
    changed = not graph.name
    graph.name = graph.name or MAIN_GRAPH
    before = [n.name for n in graph.node]
    name_nodes(graph, [])
    changed |= before != [n.name for n in graph.node]
    for node in graph.node:
        changed |= _name_subgraph_nodes(node)
    return copy, changed


def _name_subgraph_nodes(node: onnx.NodeProto) -> bool:
    """Name unnamed body nodes ``{op_type}_{j}``, as inlining and unrolling name them."""
    changed = False
    for body in _bodies(node):
        for j, inner in enumerate(body.node):
            if not inner.name:
                inner.name = f"{inner.op_type}_{j}"
                changed = True
            changed |= _name_subgraph_nodes(inner)
    return changed


def _bodies(node: onnx.NodeProto) -> Iterator[onnx.GraphProto]:
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            yield attr.g
        yield from attr.graphs


def locations(model: onnx.ModelProto) -> dict[str, tuple[str, str]]:
    """Our node name -> (graph id, node id) in Model Explorer, for a model named by
    ``explorer_model``."""
    main = model.graph.name
    where = {n.name: (main, n.name) for n in model.graph.node}
    for node in model.graph.node:
        if node.op_type == "If" and node.domain in ("", "ai.onnx"):
            _branch_nodes(node, node.name, main, where)
        else:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    gid = f"{node.name}/{attr.name}"
                    for inner in attr.g.node:
                        where.setdefault(f"{gid}/{inner.name}", (gid, inner.name))
    return where


def _branch_nodes(
    node: onnx.NodeProto, shown: str, main: str, where: dict[str, tuple[str, str]]
) -> None:
    """An If's branch nodes, drawn in the main graph under the If's own (drawn) name."""
    for attr in node.attribute:
        if attr.type != onnx.AttributeProto.GRAPH:
            continue
        for inner in attr.g.node:
            drawn = f"{shown}/{attr.name}/{inner.name}"
            # Inlining keeps the branch node's name unless it clashes, then prefixes it.
            where.setdefault(f"{node.name}/{attr.name}/{inner.name}", (main, drawn))
            where.setdefault(inner.name, (main, drawn))
            if inner.op_type == "If":
                _branch_nodes(inner, drawn, main, where)


def _place(name: str, where: dict[str, tuple[str, str]]) -> tuple[str, str] | None:
    if name in where:
        return where[name]
    m = _ITERATION.match(name)
    return where.get(f"{m['loop']}/body/{m['node']}") if m else None


def overlay(
    result: BisectResult, model: onnx.ModelProto, which: Overlay
) -> dict[str, dict[str, Any]]:
    """The node-data JSON of one overlay, keyed by graph id and Model Explorer's node ids."""
    where = locations(model)
    graphs: dict[str, dict[str, dict[str, Any]]] = {}
    for n in result.nodes:
        comparison = which.comparison(n)
        place = _place(n.name, where)
        if comparison is None or place is None or math.isnan(comparison.score):
            continue
        # A NaN or Inf error is the worst there is, whatever the finite values' error.
        value = _TOP if comparison.nonfinite else min(float(comparison.score), _TOP)
        results = graphs.setdefault(place[0], {})
        if place[1] in results and results[place[1]]["value"] >= value:
            continue  # another loop iteration of the same body node was worse
        # Each tensor has its own threshold under --threshold auto: its verdict colours it.
        results[place[1]] = {"value": value, "bgColor": _BAD if comparison.diverged else _OK}
    crit = result.criterion
    # A fixed threshold becomes Model Explorer's legend; under --threshold auto or atol/rtol
    # each tensor has its own, and only the nodes' own colours can say it.
    scale = {}
    if crit.noise is None and not crit.allclose:
        scale = {"thresholds": [{"value": crit.threshold, "bgColor": _OK}, _ABOVE]}
    return {
        gid: {"name": which.title, "results": results, **scale} for gid, results in graphs.items()
    }


def write_explorer(result: BisectResult, out_dir: Path) -> list[Path]:
    """The overlays (and the renamed model, when needed) in ``out_dir``; nothing when the
    model is not a file this process can read."""
    path = Path(result.model)
    if not result.nodes or not path.is_file():
        return []
    try:
        original = onnx.load(str(path), load_external_data=False)
    except Exception:  # protobuf raises several types; the other reports still stand
        return []
    model, renamed = explorer_model(original)
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    if renamed:
        # Weights stay where they were: the adapter never loads external data.
        onnx.save(model, str(out_dir / "model.onnx"))
        written.append(out_dir / "model.onnx")
    for which in OVERLAYS:
        data = overlay(result, model, which)
        if data:
            # One line per node: results sit under graph id and "results".
            (out_dir / which.file).write_text(json_text(data, expand=3, indent=1))
            written.append(out_dir / which.file)
    # The copy's path is relative: the directory is written in staging and moved.
    shown = "model.onnx" if renamed else str(path.resolve())
    manifest = {"model": shown, "overlays": [p.name for p in written if p.suffix == ".json"]}
    (out_dir / "view.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return [*written, out_dir / "view.json"]


def read_explorer(out: Path) -> ExplorerFiles | None:
    """What ``write_explorer`` left in a report directory ``out``, or None."""
    manifest = out / EXPLORER_DIR / "view.json"
    if not manifest.is_file():
        return None
    data = json.loads(manifest.read_text())
    model = Path(data["model"])
    if not model.is_absolute():
        model = out / EXPLORER_DIR / model
    return ExplorerFiles(model, tuple(out / EXPLORER_DIR / f for f in data["overlays"]))
