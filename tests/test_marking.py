"""The observer effect localized: the tensor whose marking changes the target's result is
found, kept unmarked, and the search that follows names the fused nodes."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import onnx_bisect
from tests.faulty import FoldFaultBackend, FusionFaultBackend
from tests.models import make


def fused_model() -> onnx.ModelProto:
    """x -> sig (t) -> exp -> tanh -> relu -> mix(relu, t) -> y: ``t`` is read by ``exp`` and
    again by the last node, so it is live across every cut after ``sig``."""
    nodes = [
        helper.make_node("Sigmoid", ["x"], ["t"], name="sig"),
        helper.make_node("Exp", ["t"], ["e"], name="exp"),
        helper.make_node("Tanh", ["e"], ["h"], name="tanh"),
        helper.make_node("Mul", ["h", "w"], ["r"], name="scale"),
        helper.make_node("Add", ["r", "t"], ["y"], name="mix"),
    ]
    w = numpy_helper.from_array(np.full((1, 16), 3.0, np.float32), "w")
    return make(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16])],
        [w],
    )


def test_the_tensor_whose_marking_hides_a_fusion_is_named_and_kept() -> None:
    # exp is wrong only while t is computed and not observed: a fusion sig -> exp. Marking t
    # (the scan does, and so does every cut, t being live to the end) hides the fault.
    target = FusionFaultBackend("exp", "t", 0.5)
    result = onnx_bisect.bisect(fused_model(), target=target)
    assert result.verdict == "diverged"
    assert result.strategy == "scan+bisect"
    assert "marking 't' alone changes the target's result (y moves rel_l2 " in "\n".join(
        result.notes
    )
    note = next(n for n in result.notes if n.startswith("marking 't'"))
    assert note.endswith(
        "a fusion from Sigmoid 'sig' to its readers (exp, mix) that marking undoes; the cut "
        "search and the pattern windows never mark it"
    )
    # With t unmarked, the cut after exp shows the fault; exp alone (t fed) is right, and the
    # window sig -> exp, t left unobserved, reproduces it.
    assert result.search is not None and result.search.transition_node == "exp"
    assert result.first_divergence is not None and result.first_divergence.name == "exp"
    assert result.root_cause is not None and result.root_cause.kind == "pattern"
    assert result.root_cause.nodes == ("sig", "exp")


def test_the_cut_search_asked_for_directly_marks_every_live_tensor() -> None:
    target = FusionFaultBackend("exp", "t", 0.5)
    result = onnx_bisect.bisect(fused_model(), target=target, strategy="bisect")
    # Asked for the cut search directly, nothing is kept: t is marked at every cut and the
    # fault shows only in the plain model, at its last node.
    assert result.search is not None and result.search.transition_node == "mix"
    assert not any(n.startswith("marking 't'") for n in result.notes)


def shape_bias_model() -> onnx.ModelProto:
    """y = Relu(Tanh(x) + ConstantOfShape(Shape(x))): the bias depends on x's shape alone."""
    fill = numpy_helper.from_array(np.array([0.5], np.float32), "fill_value")
    nodes = [
        helper.make_node("Shape", ["x"], ["s"], name="shape"),
        helper.make_node("ConstantOfShape", ["s"], ["b"], name="fill", value=fill),
        helper.make_node("Tanh", ["x"], ["t"], name="tanh"),
        helper.make_node("Add", ["t", "b"], ["a"], name="add"),
        helper.make_node("Relu", ["a"], ["y"], name="relu"),
    ]
    return make(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16])],
    )


def test_a_window_with_the_shape_determined_bias_folded_in_reproduces() -> None:
    # add is wrong only while b is a constant of the model: fed b as an input (isolation, the
    # plain windows) it is right; with b embedded, as the target folds it, it is not.
    result = onnx_bisect.bisect(
        shape_bias_model(), target=FoldFaultBackend("add", "b", "shape", 0.5)
    )
    assert result.first_divergence is not None and result.first_divergence.name == "add"
    assert result.root_cause is not None and result.root_cause.kind == "pattern"
    assert result.root_cause.nodes == ("tanh", "add")
    assert result.root_cause.reason.endswith(
        "a pattern or fusion bug; with the tensors the input shapes alone determine embedded "
        "as constants, as the target folds them at static shapes"
    )
