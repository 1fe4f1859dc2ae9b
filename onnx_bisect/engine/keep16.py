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

A torch target computing in float16 or bfloat16 (``torch:cpu?dtype=float16``, no float32 model
to convert) gets the same search on the target itself: each set is computed in float32 by the
torch interpreter (``FLOAT32_NODES``, as autocast computes a module it excludes), and the
answer names the modules the nodes come from; as a ``node_block_list`` it is also converted
by onnxconverter-common and run on the reference once, and the note says whether it holds
there too.

Each trial is measured on every input of the goal (``engine/measure/goals.py``: the dataset's
with ``--dataset``, stopping at the first input that misses), and ``--quant-goal`` may be a
task goal (``compare/goal.py``: top-1 agreement or rel_l2, at the last position).

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

from onnx_bisect.backends.spec import parse_spec
from onnx_bisect.backends.torch.options import with_float32_nodes
from onnx_bisect.compare.precision import Precision, format_of
from onnx_bisect.compare.tensors import compare_tensors
from onnx_bisect.engine.diagnose import Diagnosis
from onnx_bisect.engine.measure.goals import GoalRuns, goal_runs
from onnx_bisect.engine.passes.search import find_guilty
from onnx_bisect.engine.session import Session, Setup
from onnx_bisect.errors import BackendError, ModelLoadError, SpecError
from onnx_bisect.graph.sizes import model_bytes
from onnx_bisect.graph.source import node_source
from onnx_bisect.graph.view import LoadedModel
from onnx_bisect.graph.weights import with_loaded_weights
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
    """The keep-in-fp32 answer for a float16 conversion (``+fp16``, an fp16 target model) or
    a torch target computing in float16/bfloat16 (``dtype=``) that diverged with flagged
    nodes; None where there is nothing to search (neither, no flagged node)."""
    setup, found, screened = session.setup, diagnosis.found, diagnosis.screened
    if not diagnosis.diverged or found is None or screened is None:
        return None
    graph = setup.loaded
    apply = _applier(setup)
    if apply is None or already_low(graph.model) > 50:
        return None  # a float16 model judged as it is: there is no float32 model to convert
    if not model_bytes(graph.model).fits:
        # Each trial copies (and converts) the model in this process: past 2 GB, onnx's
        # inference serializes it in vain.
        log.info("keep in float32 not searched: the model is over 2 GB")
        return None
    flagged = [n.name for n in found.nodes if n.verdict in _FLAGGED]
    flagged += found.cause.nodes if found.cause is not None else ()
    if not flagged:
        return None
    inputs = goal_runs(session)
    inputs.references(dict(screened.ref_outputs))
    judge, goal, figure, worst = _goal(session, len(inputs.feeds))

    def run(keep: Collection[str], ops: Collection[str], full: bool) -> list[_Judged]:
        try:
            return inputs.figures(apply.model(keep, ops), judge, None if full else _missed)
        except (BackendError, ModelLoadError, ValueError, KeyError) as exc:
            # The converter itself raises ValueError or KeyError on some block lists (its cast
            # cleanup: "The downstream node of the second cast node should be graph output").
            log.info("keeping %s %s in float32 failed: %s", sorted(keep), sorted(ops), exc)
            return [(math.inf, False)]

    trials = _Trials(run, len(inputs.feeds), worst)
    candidates = apply.candidates
    suspects = [n for n in dict.fromkeys(flagged) if n in candidates]
    with session.timer.stage("keep in fp32"):
        before, _ = trials.measure((), full=True)
        first = trials.last
        keep, note = _search(trials, candidates, _pools(graph, suspects, candidates))
        if not keep:
            note = _beyond_range(graph, suspects) or note
        keep = apply.nodes(keep)
        ops = _one_op(graph, keep, trials) if apply.ops else ()
        trials.budget = None
        after, verified, last = before, False, None
        if keep or ops:
            after, verified = trials.measure(() if ops else keep, ops, True)
            last = trials.last
        also = apply.cross_check(inputs, judge, keep) if keep and verified and not ops else ""
    return KeepInFp32(
        **apply.answer(keep, ops),
        goal=goal,
        before=before,
        after=after,
        verified=verified,
        verified_by=apply.verified_by,
        runs=trials.runs,
        note="; ".join(n for n in (note, also) if n),
        figure=figure,
        per_input=_per_input(inputs.labels, first, last),
    )


class _Convert:
    """A float16 conversion's set applied as the user applies it: onnxconverter-common
    converts the float model again with the set kept in float32; the call to paste."""

    ops = True

    def __init__(self, setup: Setup, target: LoadedModel) -> None:
        graph = setup.loaded
        self.graph = graph
        self.base = blocks_of(target.model) or base_blocks(graph.model)
        self.inferred = _inferred(graph.model)
        self.converted: dict[tuple[frozenset[str], frozenset[str]], BlockList] = {}
        base = self.base
        self.candidates = [
            n.name for n in graph.nodes if n.name not in base.nodes and n.op_type not in base.ops
        ]
        where = setup.target_info.description or setup.target_info.spec
        self.verified_by = (
            f"converting again with onnxconverter-common and running it on the target ({where})"
        )

    def model(self, keep: Collection[str], ops: Collection[str]) -> onnx.ModelProto:
        model, blocks = convert_valid(self.inferred, self.base.plus(list(keep), list(ops)))
        self.converted[frozenset(keep), frozenset(ops)] = blocks
        return model

    def nodes(self, keep: tuple[str, ...]) -> tuple[str, ...]:
        """What onnx made the conversion keep with the set (an initializer shared with a
        kept node, say) is part of the answer: the printed call keeps it too."""
        return _added(self.converted.get((frozenset(keep), frozenset())), self.base) or keep

    def answer(self, keep: tuple[str, ...], ops: tuple[str, ...]) -> dict[str, Any]:
        key = (frozenset(() if ops else keep), frozenset(ops))
        final = self.converted.get(key, self.base)
        named = names_given(final.nodes, self.graph.model.graph)
        return {
            "nodes": _added(final, self.base),
            "kind": "op_block_list" if ops else "node_block_list",
            "ops": ops,
            "call": final.call(),
            "prepare": NAME_NODES if named else "",
        }

    def cross_check(self, inputs: GoalRuns, judge: _Judge, keep: Sequence[str]) -> str:
        return ""  # verified as converted already


class _Float32Nodes(_Convert):
    """A torch target computing in float16 or bfloat16 (``dtype=``): the target itself
    computes the set in float32 (``FLOAT32_NODES``: the operands cast up, its readers'
    cast back, as autocast does for an excluded module); the answer names the modules the
    nodes come from, and is also converted by onnxconverter-common as a ``node_block_list``
    and run on the reference, for an ONNX user."""

    ops = False

    def __init__(self, setup: Setup) -> None:
        self.graph = setup.loaded
        self.base = base_blocks(self.graph.model)
        self.candidates = [n.name for n in self.graph.nodes]
        self.ref_label = setup.ref_info.description or setup.ref_info.spec
        self.verified_by = (
            f"running it on the target with the set in float32 ({setup.target_info.spec}, "
            "these nodes' operands cast to float32 and their readers' back, as autocast "
            "does for a module excluded from it)"
        )

    def model(self, keep: Collection[str], ops: Collection[str]) -> onnx.ModelProto:
        return with_float32_nodes(self.graph.model, keep)

    def nodes(self, keep: tuple[str, ...]) -> tuple[str, ...]:
        return keep

    def answer(self, keep: tuple[str, ...], ops: tuple[str, ...]) -> dict[str, Any]:
        sources = [node_source(self.graph.node_protos[n]) for n in keep]
        modules = tuple(dict.fromkeys(s.module for s in sources if s is not None and s.module))
        blocks = self.base.plus(list(keep))
        named = names_given(blocks.nodes, self.graph.model.graph)
        return {"nodes": keep, "kind": "node_block_list", "ops": (), "call": blocks.call(),
                "prepare": NAME_NODES if named else "", "modules": modules}  # fmt: skip

    def cross_check(self, inputs: GoalRuns, judge: _Judge, keep: Sequence[str]) -> str:
        """The set as a node_block_list, converted by onnxconverter-common and run on the
        reference: does the goal hold there too (what an ONNX user gets)?"""
        try:
            model, _ = convert_valid(_inferred(self.graph.model), self.base.plus(list(keep)))
            judged = inputs.figures(model, judge, backend=inputs.session.ref)
        except (BackendError, ModelLoadError, ValueError, KeyError, ImportError) as exc:
            return f"as a node_block_list not checked: {exc}"
        met = sum(ok for _, ok in judged)
        state = "meets the goal" if met == len(judged) else "MISSES the goal"
        on = "" if len(judged) == 1 else f" on {met} of {len(judged)} inputs"
        return (
            "as a node_block_list, converted by onnxconverter-common and run on the reference "
            f"({self.ref_label}), it {state}{on}"
        )


def _inferred(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model to convert: its external weights read in (the converter rewrites each
    weight's type, and a float16 tensor left pointing at float32 bytes fails to load), its
    shapes inferred."""
    return onnx.shape_inference.infer_shapes(with_loaded_weights(model))


def _applier(setup: Setup) -> _Convert | None:
    """How a set is kept in float32 on this target: a float16 conversion converted again,
    a torch dtype=float16/bfloat16 target told per node; None for anything else."""
    precision = setup.target_precision.precision
    if precision is Precision.FLOAT16 and setup.target_model is not None:
        return _Convert(setup, setup.target_model)
    if setup.target_model is not None or precision not in (Precision.FLOAT16, Precision.BFLOAT16):
        return None
    try:
        spec = parse_spec(setup.target_info.spec)
    except SpecError:
        return None
    if spec.name != "torch" or spec.option("dtype") not in ("float16", "bfloat16"):
        return None  # another runtime's own float16 converts every node, with no way to say
    return _Float32Nodes(setup)


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

    lost = _lost_floors(session)

    def judge(ref_out: Tensors, out: Tensors) -> _Judged:
        worst, ok = 0.0, True
        for name, ref in ref_out.items():
            c = compare_tensors(name, ref, out.get(name), crit)
            rel = c.metrics.get("rel_l2", math.inf) if not c.range_problem else math.inf
            worst = max(worst, rel if rel == rel else math.inf)
            ok = ok and (rel <= lost[name] if name in lost else not c.diverged)
        # rel_l2 >= 1: an output that lost its values (all zero) is no answer, whatever the
        # floors allow (a detector's tiny probabilities on random input have floors above 1).
        return worst, worst <= goal.bound if goal is not None else ok and worst < _NO_SIGNAL

    on = "" if inputs == 1 else f" on every one of {inputs} inputs"
    figure = "worst output rel_l2"
    if goal is not None:
        return judge, f"worst output rel_l2 <= {goal.bound:g}{on} (--quant-goal)", figure, max
    what = crit.agreement()
    if crit.floors is not None:
        what = f"{crit.floors.precision.value}'s predicted error"
    if lost:
        shown = ", ".join(f"{n} rel_l2 <= {v:.2g}" for n, v in lost.items())
        name = crit.floors.precision.value if crit.floors is not None else "the precision"
        what += (
            f" ({shown}: {name}'s faithful twin overflows before it, so it is held to "
            f"{_LOST_UNITS} units of rounding)"
        )
    return judge, f"every output within {what}{on}", figure, max


# Where the precision's own faithful twin overflowed before an output (its accumulated floor
# 0 below a positive isolated one: no prediction), the output is held to this many units of
# the precision's rounding (float16: 0.0098; bfloat16: 0.078).
_LOST_UNITS = 20


def _lost_floors(session: Session) -> dict[str, float]:
    """The outputs whose predicted error the overflow itself took away, each with the bound
    that stands in for it."""
    floors = session.crit.floors
    if floors is None:
        return {}
    bound = _LOST_UNITS * format_of(floors.precision).unit
    out = {}
    for name in session.loaded.outputs:
        whole, alone = floors.accumulated.get(name), floors.isolated.get(name)
        if whole == 0.0 and alone is not None and alone > 0.0:
            out[name] = bound
    return out
