"""Wrong answers found on real models (the zoo, issue 33's first rank), each reproduced on a
model built here: a planted fault missed, a false alarm, a wrongly named culprit."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import onnx_bisect
from onnx_bisect import Verdict
from onnx_bisect.result import CauseKind
from tests.faulty import FaultyBackend
from tests.models import IR, OPSET


def lstm_bias_chain(seed: int = 0) -> onnx.ModelProto:
    """Concat(b1, b2) -> Unsqueeze -> LSTM's B -> Squeeze: silero-vad's decoder LSTM gets its
    biases so (zoo G5)."""
    rng, hidden, size = np.random.default_rng(seed), 4, 3

    def init(name: str, shape: tuple[int, ...]) -> onnx.TensorProto:
        return numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)

    inits = [
        init("W", (1, 4 * hidden, size)),
        init("R", (1, 4 * hidden, hidden)),
        init("b1", (4 * hidden,)),
        init("b2", (4 * hidden,)),
        numpy_helper.from_array(np.array([0], np.int64), "ax"),
    ]
    nodes = [
        helper.make_node("Concat", ["b1", "b2"], ["bc"], axis=0, name="cat"),
        helper.make_node("Unsqueeze", ["bc", "ax"], ["B"], name="unsq"),
        helper.make_node(
            "LSTM", ["x", "W", "R", "B"], ["Y", "Yh"], hidden_size=hidden, name="lstm"
        ),
        helper.make_node("Squeeze", ["Yh", "ax"], ["y"], name="sq"),
    ]
    graph = helper.make_graph(
        nodes,
        "lstm_bias",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [5, 1, size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, hidden])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = IR
    return model


def test_a_changed_constant_carried_through_another_constant_is_the_root_cause() -> None:
    """The planted Concat's change reaches the LSTM through an Unsqueeze of it; measured alone
    (fed the reference's Concat) the Unsqueeze agrees, and it was called harmless, which
    carried the change away and left no root cause (zoo G5: silero-vad's planted fault
    missed). The Unsqueeze carries the Concat's change: the Concat is the root cause."""
    result = onnx_bisect.bisect(lstm_bias_chain(), target=FaultyBackend("cat", 0.05))
    verdicts = {n.name: n.verdict for n in result.nodes}
    assert verdicts == {
        "cat": Verdict.PARAMETER,
        "unsq": Verdict.PARAMETER,
        "lstm": Verdict.PROPAGATED,
        "sq": Verdict.PROPAGATED,
    }
    assert result.first_divergence is not None and result.first_divergence.name == "lstm"
    cause = result.root_cause
    assert cause is not None and (cause.kind, cause.nodes) == (CauseKind.PARAMETER, ("cat",))
    assert cause.reason.startswith(
        "1 constant holds different values on the target (cat: rel_l2=0.05 > threshold"
    ), cause.reason
    assert result.diverged  # exit 1
