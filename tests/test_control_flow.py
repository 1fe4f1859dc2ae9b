"""Faults inside If branches are named at the branch's node, not at the If; the report says
which branch ran. Real ONNX Runtime sessions; faults planted inside the bodies."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import onnx_bisect
from onnx_bisect.graph.inline import inline_branches
from onnx_bisect.result import CauseKind
from tests.faulty import FaultyBackend
from tests.models import make, with_if


def nested_if() -> onnx.ModelProto:
    """x -> Relu -> If(sum > 0) whose then-branch holds a second If (on max > 1) of its own;
    a branch node named like a main-graph node ("relu") must be renamed, not clash."""
    inner_then = helper.make_graph(
        [helper.make_node("Mul", ["r", "two"], ["inner_t"], name="double")],
        "inner_then", [], [helper.make_tensor_value_info("inner_t", TensorProto.FLOAT, [4])],
    )  # fmt: skip
    inner_else = helper.make_graph(
        [helper.make_node("Neg", ["r"], ["inner_e"], name="negate")],
        "inner_else", [], [helper.make_tensor_value_info("inner_e", TensorProto.FLOAT, [4])],
    )  # fmt: skip
    then_g = helper.make_graph(
        [
            helper.make_node("ReduceMax", ["r"], ["m"], name="max", keepdims=0),
            helper.make_node("Greater", ["m", "one"], ["c2"], name="gt2"),
            helper.make_node(
                "If", ["c2"], ["t_if"], name="inner", then_branch=inner_then,
                else_branch=inner_else,
            ),  # fmt: skip
            helper.make_node("Relu", ["t_if"], ["then_out"], name="relu"),
        ],
        "then", [], [helper.make_tensor_value_info("then_out", TensorProto.FLOAT, [4])],
    )  # fmt: skip
    else_g = helper.make_graph(
        [helper.make_node("Abs", ["r"], ["else_out"], name="abs")],
        "else", [], [helper.make_tensor_value_info("else_out", TensorProto.FLOAT, [4])],
    )  # fmt: skip
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("ReduceSum", ["r"], ["s"], name="sum", keepdims=0),
        helper.make_node("Greater", ["s", "zero"], ["c"], name="gt"),
        helper.make_node("If", ["c"], ["y0"], name="outer", then_branch=then_g, else_branch=else_g),
        helper.make_node("Sigmoid", ["y0"], ["y"], name="tail"),
    ]
    consts = {"zero": 0.0, "one": 1.0, "two": 2.0}
    return make(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
        [numpy_helper.from_array(np.array(v, np.float32), k) for k, v in consts.items()],
    )


POSITIVE = {"x": np.array([3.0, 1.0, 2.0, 0.5], np.float32)}


def test_a_fault_in_the_taken_branch_is_named_at_the_branch_node() -> None:
    result = onnx_bisect.bisect(with_if(), target=FaultyBackend("neg", 0.05), inputs=POSITIVE)
    assert result.verdict == "diverged"
    assert result.root_cause is not None and result.root_cause.kind is CauseKind.CULPRIT
    assert result.root_cause.nodes == ("neg",)
    assert any("If 'branch' took its then_branch" in n for n in result.notes)


def test_a_fault_in_the_branch_not_taken_is_no_divergence_and_says_which_branch_ran() -> None:
    result = onnx_bisect.bisect(with_if(), target=FaultyBackend("abs", 0.05), inputs=POSITIVE)
    assert result.verdict == "match"
    assert any("If 'branch' took its then_branch" in n for n in result.notes)


def test_nested_branches_are_inlined_and_a_fault_two_levels_down_is_named() -> None:
    result = onnx_bisect.bisect(nested_if(), target=FaultyBackend("double", 0.05), inputs=POSITIVE)
    assert result.verdict == "diverged"
    assert result.root_cause is not None and result.root_cause.nodes == ("double",)
    took = " ".join(result.notes)
    assert "If 'outer' took its then_branch (1 If nested in them was decided too" in took


def test_inlining_keeps_values_and_leaves_the_callers_model_alone() -> None:
    import onnxruntime as ort

    model = nested_if()
    flat, inlined = inline_branches(model, {"outer": True})
    assert [i.branch for i in inlined] == ["then_branch"]
    names = [n.name for n in flat.graph.node]
    # The branch's "relu" clashes with the main graph's: prefixed as Model Explorer names it.
    assert names.count("relu") == 1 and "outer/then_branch/relu" in names
    assert any(n.op_type == "If" for n in model.graph.node)  # untouched
    before, after = (
        ort.InferenceSession(m.SerializeToString()).run(None, POSITIVE)[0] for m in (model, flat)
    )
    np.testing.assert_array_equal(before, after)
