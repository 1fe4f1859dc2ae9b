"""What a pass bisection runs on: the subgraph around the root cause where it shows the pass
bug, else the whole model.

A subgraph is cut as a repro bundle's is (``engine/subgraphs.py``: the root cause, then windows
grown around it), fed the reference's values at its cut. The first on which the target
diverges is searched (``bisection.py``): the runtime lists only the passes that rewrite
these few nodes, and each run of the search is a run of a few nodes. Without one (no scan to
cut from, or the divergence needs more of the graph) the whole model is searched.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy.typing as npt
import onnx

from onnx_bisect.engine.found import Found
from onnx_bisect.engine.measure.observe import Observed
from onnx_bisect.engine.session import Session
from onnx_bisect.engine.subgraphs import candidates, reference_window
from onnx_bisect.result import CauseKind, PassScope
from onnx_bisect.text import plural

__all__ = ["MAX_SUBGRAPHS", "Scope", "model_scope", "subgraph_scope"]

# Subgraphs tried before the whole model; each that does not reproduce costs one target run.
MAX_SUBGRAPHS = 3


@dataclass(frozen=True)
class Scope:
    """A model to search passes on: each spec's model, its feeds and the reference's outputs."""

    kind: PassScope
    model_of: Callable[[str], onnx.ModelProto]
    feeds: Mapping[str, npt.NDArray[Any]]
    expected: Mapping[str, npt.NDArray[Any]]
    nodes: int


# Whether a spec diverges on a scope (one target run, counted by the caller).
Diverges = Callable[[str, Scope], bool]


def model_scope(
    session: Session, screened: Observed, model_of: Callable[[str], onnx.ModelProto]
) -> Scope:
    nodes = len((session.setup.target_model or session.loaded).nodes)
    return Scope(PassScope.MODEL, model_of, session.feeds, screened.ref_outputs, nodes)


def _fixed(model: onnx.ModelProto) -> Callable[[str], onnx.ModelProto]:
    """The same model for every spec: a runtime's passes switch off on the model it runs."""
    return lambda _spec: model


def subgraph_scope(
    session: Session, found: Found | None, spec: str, diverges: Diverges
) -> tuple[Scope | None, str]:
    """The smallest subgraph around the root cause on which ``spec`` diverges (of the first
    ``MAX_SUBGRAPHS``); else None and why not."""
    if found is None or found.store is None:
        return None, "the localization kept no reference values to cut a subgraph from"
    start = found.cause.nodes if found.cause and found.cause.nodes else ()
    if not start and found.first is not None:
        start = (found.first.name,)
    if not start:
        return None, "the localization named no node to cut a subgraph around"
    loaded, store = found.cut_from or session.loaded, found.store
    cuts = (c for c in candidates(loaded, store, start) if not c.prefix)
    # Localization has run the target on a culprit or pattern fed the reference's values, and
    # seen it diverge: the first candidate (those nodes) needs no run to know it.
    shown = found.cause is not None and found.cause.kind in (CauseKind.CULPRIT, CauseKind.PATTERN)
    tried = 0
    for cand in itertools.islice(cuts, MAX_SUBGRAPHS):
        tried += 1
        fed = reference_window(loaded, store, session.feeds, cand.nodes)
        scope = Scope(
            PassScope.SUBGRAPH, _fixed(fed.model), fed.inputs, fed.outputs, len(cand.nodes)
        )
        if (shown and tried == 1) or diverges(spec, scope):
            return scope, ""
    return None, (
        f"{'neither' if tried == 2 else 'none'} of the {plural(tried, 'subgraph')} around the "
        "root cause tried diverges on its own"
        if tried > 1
        else "the subgraph around the root cause does not diverge on its own"
    )
