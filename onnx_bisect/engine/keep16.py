"""Keep in float32: the smallest ``node_block_list`` that brings a float16 conversion's outputs
within what float16 predicts (or ``--quant-goal``), each candidate set tried the way the user
will apply it: onnxconverter-common converts the float model again with the set kept in
float32 (``transforms/fp16.py``'s ``convert``), and the target runs that model.

The search is the pass search's (``engine/passes/search.py``: halving for one node, then
ddmin), over pools that grow from the nodes the diagnosis flagged (culprits, ``range`` faults,
rounded constants): the flagged nodes; with their readers, since a node kept in float32 whose
output is cast back to float16 overflows again at that Cast unless its reader stays float32
too; with their readers' readers; every node. The first pool that meets the goal is searched,
within SEARCH_RUNS conversions. Where the set is several nodes of one op type, that op type
alone is tried as an ``op_block_list``.

Anchors: onnxconverter-common's ``auto_convert_mixed_precision`` (a conversion per trial under
a validate function the user writes) and ModelOpt AutoCast (magnitude heuristics, no run).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
from onnx import numpy_helper

from onnx_bisect.compare.precision import Precision
from onnx_bisect.compare.tensors import compare_tensors
from onnx_bisect.engine.diagnose import Diagnosis
from onnx_bisect.engine.measure.goals import goal_runs
from onnx_bisect.engine.passes.search import find_guilty
from onnx_bisect.engine.session import Session
from onnx_bisect.errors import BackendError, ModelLoadError
from onnx_bisect.graph.sizes import model_bytes
from onnx_bisect.graph.view import LoadedModel
from onnx_bisect.quant_result import InputFigure, KeepInFp32
from onnx_bisect.result import Verdict
from onnx_bisect.text import plural
from onnx_bisect.transforms.fp16 import (
    NAME_NODES,
    BlockList,
    already_low,
    base_blocks,
    blocks_of,
    names_given,
)
from onnx_bisect.transforms.fp16 import valid_conversion as convert_valid

__all__ = ["SEARCH_RUNS", "keep_in_fp32"]

log = logging.getLogger(__name__)

# Conversions (each a session of the whole model) the search may spend before the smallest
# set seen to meet the goal is taken.
SEARCH_RUNS = 48
# The verdicts that make a node a suspect: its own error, or a value float16 cannot hold.
_FLAGGED = frozenset({Verdict.CULPRIT, Verdict.RANGE, Verdict.PARAMETER, Verdict.PATTERN})
# An output this far off has none of its values left (rel_l2 of an all-zero output is 1).
_NO_SIGNAL = 1.0
# An op type is the answer (op_block_list) where the node set holds this many of it, only.
_OP_WIDE = 3

Tensors = Mapping[str, npt.NDArray[Any]]

# One input's figure: the worst output's rel_l2 (or the goal's figure) and whether it meets
# the goal there.
_Judged = tuple[float, bool]
_Judge = Callable[[Tensors, Tensors], _Judged]
# Keep these nodes (and these op types) in float32, measured on every input (``full``: no
# stop at the first input that misses): one judgement per input run.
_Run = Callable[[Collection[str], Collection[str], bool], list[_Judged]]


class _OutOfRuns(Exception):
    """The search's run budget is spent."""


class _Trials:
    """Converts with a set kept in float32, runs the target on every input of the goal,
    reads the worst input's figure and whether the goal holds on every input; remembers the
    smallest set that met it."""

    def __init__(self, run: _Run, inputs: int, worst: Callable[[list[float]], float]) -> None:
        self.run, self.inputs, self.worst = run, inputs, worst
        self.runs = 0
        self.budget: int | None = None
        self.best: tuple[str, ...] | None = None
        self.last: list[_Judged] = []

    def measure(
        self, keep: Collection[str], ops: Collection[str] = (), full: bool = False
    ) -> tuple[float, bool]:
        if self.budget is not None and self.runs >= self.budget:
            raise _OutOfRuns
        self.runs += 1
        self.last = judged = self.run(keep, ops, full)
        ok = len(judged) == self.inputs and all(met for _, met in judged)
        if ok and not ops and (self.best is None or len(keep) < len(self.best)):
            self.best = tuple(keep)
        return self.worst([f for f, _ in judged]), ok

    def meets(self, keep: Collection[str]) -> bool:
        return self.measure(keep)[1]


def keep_in_fp32(session: Session, diagnosis: Diagnosis) -> KeepInFp32 | None:
    """The keep-in-fp32 answer for a float16 conversion that diverged with flagged nodes; None
    where there is nothing to search (not a float16 conversion, no flagged node)."""
    setup, found, screened = session.setup, diagnosis.found, diagnosis.screened
    if not diagnosis.diverged or found is None or screened is None:
        return None
    if setup.target_precision.precision is not Precision.FLOAT16 or setup.target_model is None:
        return None  # a runtime's own float16 (torch dtype=) converts every node anyway
    graph = setup.loaded
    if already_low(graph.model) > 50:
        return None  # a float16 model judged as it is: there is no float32 model to convert
    if not model_bytes(graph.model).fits:
        # Each trial copies and converts the model in this process: past 2 GB, onnx's
        # inference serializes it in vain.
        log.info("keep in float32 not searched: the model is over 2 GB")
        return None
    flagged = [n.name for n in found.nodes if n.verdict in _FLAGGED]
    flagged += found.cause.nodes if found.cause is not None else ()
    if not flagged:
        return None
    base = blocks_of(setup.target_model.model) or base_blocks(graph.model)
    inferred = onnx.shape_inference.infer_shapes(graph.model)
    candidates = [
        n.name for n in graph.nodes if n.name not in base.nodes and n.op_type not in base.ops
    ]
    inputs = goal_runs(session)
    inputs.references(dict(screened.ref_outputs))
    judge, goal, figure, worst = _goal(session, len(inputs.feeds))
    converted: dict[tuple[frozenset[str], frozenset[str]], BlockList] = {}

    def run(keep: Collection[str], ops: Collection[str], full: bool) -> list[_Judged]:
        try:
            model, blocks = convert_valid(inferred, base.plus(list(keep), list(ops)))
            converted[frozenset(keep), frozenset(ops)] = blocks
            return inputs.figures(model, judge, None if full else _missed)
        except (BackendError, ModelLoadError, ValueError, KeyError) as exc:
            # The converter itself raises ValueError or KeyError on some block lists (its cast
            # cleanup: "The downstream node of the second cast node should be graph output").
            log.info("keeping %s %s in float32 failed: %s", sorted(keep), sorted(ops), exc)
            return [(math.inf, False)]

    trials = _Trials(run, len(inputs.feeds), worst)
    suspects = [n for n in dict.fromkeys(flagged) if n in candidates]
    with session.timer.stage("keep in fp32"):
        before, _ = trials.measure((), full=True)
        first = trials.last
        keep, note = _search(trials, candidates, _pools(graph, suspects, candidates))
        if not keep:
            note = _beyond_range(graph, suspects) or note
        # What onnx made the conversion keep with the set (an initializer shared with a
        # kept node, say) is part of the answer: the printed call keeps it too.
        keep = _added(converted.get((frozenset(keep), frozenset())), base) or keep
        ops = _one_op(graph, keep, trials)
        trials.budget = None
        after, verified, last = before, False, None
        if keep or ops:
            after, verified = trials.measure(() if ops else keep, ops, True)
            last = trials.last
    final = converted.get((frozenset(() if ops else keep), frozenset(ops)), base)
    return KeepInFp32(
        nodes=_added(final, base),
        kind="op_block_list" if ops else "node_block_list",
        ops=ops,
        call=final.call(),
        prepare=NAME_NODES if names_given(final.nodes, graph.model.graph) else "",
        goal=goal,
        before=before,
        after=after,
        verified=verified,
        verified_by="converting again with onnxconverter-common and running it on the target "
        f"({setup.target_info.description or setup.target_info.spec})",
        runs=trials.runs,
        note=note,
        figure=figure,
        per_input=_per_input(inputs.labels, first, last),
    )


def _missed(judged: _Judged) -> bool:
    return not judged[1]


def _per_input(
    labels: Sequence[str], before: Sequence[_Judged], after: Sequence[_Judged] | None
) -> tuple[InputFigure, ...]:
    """Each input's figure before and with the set (a failed run: one infinite figure)."""
    if len(before) != len(labels) or (after is not None and len(after) != len(labels)):
        return ()
    return tuple(
        InputFigure(
            label,
            b[0],
            None if after is None else after[i][0],
            b[1] if after is None else after[i][1],
        )  # fmt: skip
        for i, (label, b) in enumerate(zip(labels, before, strict=True))
    )


# float16's largest finite value.
_FP16_MAX = 65504.0


def _beyond_range(graph: LoadedModel, suspects: Sequence[str]) -> str:
    """Why no block list can hold, where a flagged Constant holds values float16 cannot:
    onnxconverter-common 1.16 casts a kept Constant's output back to float16 (its cleanup
    keeps a Cast after a Constant), and a kept node's initializers are converted once it has
    cast its inputs. A BatchNormalization's variance (PP-OCRv4 det: 9.8e7) folds into the
    Conv before it, whose weights float16 holds."""
    for name in suspects:
        node = graph.node_protos.get(name)
        if node is None or node.op_type != "Constant":
            continue
        values = [numpy_helper.to_array(a.t) for a in node.attribute if a.name == "value"]
        if not values or values[0].dtype.kind != "f" or not values[0].size:
            continue
        largest = float(np.abs(values[0]).max())
        if largest <= _FP16_MAX:
            continue
        readers = [r for o in node.output for r in graph.readers.get(o, ())]
        text = (
            f"{name} holds values up to {largest:.3g}, beyond float16's 65504, and "
            "onnxconverter-common casts a kept Constant's output to float16 all the same (and "
            "converts a kept node's initializers once it has cast its inputs): no block list "
            "keeps it"
        )
        norms = [r.name for r in readers if r.op_type == "BatchNormalization"]
        if norms:
            text += (
                f"; fold {', '.join(norms)} into the Conv before it first (onnxsim, or "
                "onnxoptimizer's fuse_bn_into_conv; here: +onnxsim+fp16)"
            )
        return text
    return ""


def _added(blocks: BlockList | None, base: BlockList) -> tuple[str, ...]:
    return tuple(n for n in blocks.nodes if n not in base.nodes) if blocks else ()


def _pools(
    graph: LoadedModel, suspects: Sequence[str], candidates: Sequence[str]
) -> list[tuple[str, ...]]:
    """The node sets searched in turn, each in graph order and once: the flagged nodes where
    a fault starts (none of their inputs comes from a flagged node: an overflow's NaN
    downstream is its consequence), with their readers; every flagged node, with its
    readers, with its readers' readers; every node."""
    order = {n: i for i, n in enumerate(candidates)}
    outputs = {n.name: n.outputs for n in graph.nodes}
    producer = graph.producer
    flagged = set(suspects)

    def grow(pool: Sequence[str]) -> list[str]:
        readers = [r.name for n in pool for o in outputs[n] for r in graph.readers.get(o, ())]
        return [n for n in dict.fromkeys([*pool, *readers]) if n in order]

    def start(name: str) -> bool:
        inputs = graph.node_protos[name].input
        return not any(i in producer and producer[i].name in flagged for i in inputs)

    roots = [n for n in suspects if start(n)]
    grown = grow(suspects)
    raw = [roots, grow(roots), list(suspects), grown, grow(grown), list(candidates)]
    pools = [tuple(sorted(dict.fromkeys(p), key=order.__getitem__)) for p in raw if p]
    return list(dict.fromkeys(pools))


def _search(
    trials: _Trials, candidates: Sequence[str], pools: Sequence[tuple[str, ...]]
) -> tuple[tuple[str, ...], str]:
    """The nodes to keep in float32 (ddmin in the first pool that meets the goal), and a note
    where the search fell short."""
    trials.budget = trials.runs + SEARCH_RUNS
    try:
        for pool in pools:
            if trials.meets(pool):
                return find_guilty(list(pool), trials.meets).guilty or pool, ""
    except _OutOfRuns:
        if trials.best is not None:
            return trials.best, (
                f"the search stopped after {SEARCH_RUNS} conversions: "
                f"{plural(len(trials.best), 'node')} meet the goal, perhaps not the fewest"
            )
        return (), f"no set met the goal within {SEARCH_RUNS} conversions"
    return (), (
        "even with every node in float32 the goal is missed: the outputs differ by more than "
        "the float16 conversion"
    )


def _one_op(graph: LoadedModel, keep: Sequence[str], trials: _Trials) -> tuple[str, ...]:
    """The op type, where the set is _OP_WIDE or more nodes all of it and keeping that op
    type everywhere meets the goal too (one line instead of a list of names)."""
    ops = {n.name: n.op_type for n in graph.nodes}
    kinds = {ops[n] for n in keep}
    if len(keep) < _OP_WIDE or len(kinds) != 1:
        return ()
    try:
        return tuple(kinds) if trials.measure((), tuple(kinds))[1] else ()
    except _OutOfRuns:
        return ()


def _goal(session: Session, inputs: int) -> tuple[_Judge, str, str, Callable[[list[float]], float]]:
    """How one input is judged, the goal in words, what the figure is, and the worst of the
    inputs' figures: every output within what the target's precision predicts (the
    criterion that judged the outputs) and the worst output's rel_l2; or ``--quant-goal``:
    a number bounding the worst output's rel_l2, or a task goal's own figure."""
    goal = session.options.goal()
    crit = session.crit
    if goal is not None and goal.task:

        def task(ref: Tensors, out: Tensors) -> _Judged:
            value = goal.figure(ref, out)
            return value, goal.met(value)

        return task, goal.describe(inputs), goal.figure_name, goal.worst

    def judge(ref_out: Tensors, out: Tensors) -> _Judged:
        worst, ok = 0.0, True
        for name, ref in ref_out.items():
            c = compare_tensors(name, ref, out.get(name), crit)
            rel = c.metrics.get("rel_l2", math.inf) if not c.range_problem else math.inf
            worst = max(worst, rel if rel == rel else math.inf)
            ok = ok and not c.diverged
        # rel_l2 >= 1: an output that lost its values (all zero) is no answer, whatever the
        # floors allow (a detector's tiny probabilities on random input have floors above 1).
        return worst, worst <= goal.bound if goal is not None else ok and worst < _NO_SIGNAL

    on = "" if inputs == 1 else f" on every one of {inputs} inputs"
    figure = "worst output rel_l2"
    if goal is not None:
        return judge, f"worst output rel_l2 <= {goal.bound:g}{on} (--quant-goal)", figure, max
    what = "float16's predicted error" if crit.floors is not None else crit.agreement()
    return judge, f"every output within {what}{on}", figure, max
