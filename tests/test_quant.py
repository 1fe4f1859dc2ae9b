"""Quantized target models (issue 27): float models built here, quantized by onnxruntime, then
bisected through the CLI against the float model."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from typer.testing import CliRunner

import onnx_bisect
from onnx_bisect.backends.protocol import BackendBase, Tensors
from onnx_bisect.backends.registry import create_backend
from onnx_bisect.backends.spec import BackendSpec
from onnx_bisect.cli import bisect_app
from onnx_bisect.compare.quant import QParams, QuantKind, dequantize, quant_error, quantize
from onnx_bisect.engine import diagnose
from onnx_bisect.engine.quant import keep
from onnx_bisect.result import Verdict
from tests import quant_models as qm
from tests.models import make
from tests.test_settle import SlowOracle

pytest.importorskip("onnxruntime.quantization")

FORMS = ("qdq", "qdq-per-channel", "qoperator", "dynamic")


def _bisect(src: Path, dst: Path, out: Path) -> tuple[int, dict[str, object], str]:
    result = CliRunner().invoke(
        bisect_app,
        [str(src), "--target-model", str(dst), "--target", "cpu", "--out", str(out),
         "--format", "md,json,html"],
    )  # fmt: skip
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    report = json.loads((out / "report.json").read_text())
    return result.exit_code, report, result.output


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("build", [qm.detector, qm.block], ids=["detector", "block"])
def test_every_int8_form_runs_and_pairs_or_explains_every_quantized_tensor(
    tmp_path: Path, form: str, build: object
) -> None:
    src, dst = qm.quantized(build(), tmp_path, form)  # type: ignore[operator]
    code, report, output = _bisect(src, dst, tmp_path / "out")
    assert code == 1, output
    assert "Traceback" not in output
    quant = report["quantization"]
    assert isinstance(quant, dict)
    paired = sum(quant["paired_by_rule"].values())
    assert paired + len(quant["unpaired"]) > 0
    assert all(u["reason"] for u in quant["unpaired"])
    assert report["root_cause"]["kind"] == "quantization"  # type: ignore[index]
    assert paired > 0
    # A dynamic model's only unpaired tensors are its run-time scales and zero points.
    assert all(u["reason"].startswith("the run-time ") for u in quant["unpaired"])
    assert form == "dynamic" or not quant["unpaired"]
    # Fed quantized operands, every quantized node runs alone (float into uint8 would not).
    verdicts = {n["verdict"] for n in report["nodes"]}  # type: ignore[union-attr]
    assert not verdicts & {"failed", "unsupported", "crashed"}


@pytest.mark.parametrize(
    ("activation", "weight"), [("QInt16", "QInt8"), ("QUInt16", "QInt4"), ("QUInt8", "QInt4")]
)
def test_int16_activations_and_int4_weights_run_and_pair(
    tmp_path: Path, activation: str, weight: str
) -> None:
    """The wider and narrower QDQ types onnxruntime runs: every quantized tensor is paired
    (int16 and int4 read in real units like int8), and the answer is a quantization one."""
    src, dst = qm.quantized(qm.block(), tmp_path, "qdq", activation, weight)
    code, report, output = _bisect(src, dst, tmp_path / "out")
    assert code == 1, output
    assert "Traceback" not in output
    quant = report["quantization"]
    assert isinstance(quant, dict)
    assert sum(quant["paired_by_rule"].values()) > 0 and not quant["unpaired"]
    assert report["root_cause"]["kind"] == "quantization"  # type: ignore[index]
    verdicts = {n["verdict"] for n in report["nodes"]}  # type: ignore[union-attr]
    assert not verdicts & {"failed", "unsupported", "crashed"}


@pytest.mark.parametrize("build", [qm.detector, qm.block], ids=["detector", "block"])
def test_dynamic_quantization_is_compared_under_its_run_time_scales(
    tmp_path: Path, build: object
) -> None:
    """quantize_dynamic's integers are read with the scales the model computed: each
    DynamicQuantizeLinear output pairs with the tensor it quantizes, each MatMulInteger or
    ConvInteger accumulator and its Cast with the float op's output; the table has their round
    trips, and rounding as designed names no culprit."""
    src, dst = qm.quantized(build(), tmp_path, "dynamic")  # type: ignore[operator]
    code, report, output = _bisect(src, dst, tmp_path / "out")
    assert code == 1, output
    quant = report["quantization"]
    rules = quant["paired_by_rule"]  # type: ignore[index]
    assert rules["run-time scale"] > 0 and rules["accumulator × run-time scales"] > 0
    rows = quant["tensors"]  # type: ignore[index]
    assert rows and all(r["kind"] == "rounding" for r in rows)
    by_node = {n["node"]: n for n in report["nodes"]}  # type: ignore[union-attr]
    integer = [n for n in by_node.values() if n["op_type"] in ("MatMulInteger", "ConvInteger")]
    assert integer and all(n["isolated"] for n in integer)  # isolated on quantized operands
    assert not [n for n in by_node.values() if n["verdict"] == "culprit"]
    cause = report["root_cause"]
    assert cause["kind"] == "quantization" and not cause["nodes"]  # type: ignore[index]
    assert "within its quantization error" in cause["reason"]  # type: ignore[index]
    # The keep-in-float search runs for this form too: nothing small to keep in float, and
    # every node it measured is the float model's.
    keep = quant["keep_in_float"]  # type: ignore[index]
    assert keep["nodes"] == [] and keep["runs"] > 2
    floats = {n.name for n in onnx.load(src).graph.node}
    assert {s["node"] for s in quant["sensitivity"]} <= floats  # type: ignore[index]
    assert output.splitlines()[1].startswith("Quantization: ")


def test_a_wrong_integer_kernel_of_a_dynamic_model_is_the_culprit(tmp_path: Path) -> None:
    """The same comparison finds a real fault: a backend whose ConvInteger output is off
    by a few steps of its accumulator is named, the others stay within rounding."""
    _, dst = qm.quantized(qm.detector(), tmp_path, "dynamic")
    src = tmp_path / "float.onnx"
    result = onnx_bisect.bisect(
        str(src), target_model=str(dst), target=AccFault("box_conv_quant", 0.05)
    )
    culprits = [n.name for n in result.nodes if n.verdict is Verdict.CULPRIT]
    assert culprits == ["box_conv_quant"]


def test_a_concat_of_a_unit_and_a_wide_branch_is_kept_in_float(tmp_path: Path) -> None:
    src, dst = qm.quantized(qm.detector(), tmp_path, "qdq")
    code, report, output = _bisect(src, dst, tmp_path / "out")
    assert code == 1
    quant = report["quantization"]
    keep = quant["keep_in_float"]  # type: ignore[index]
    assert keep["nodes"] == ["head_concat"]
    assert keep["verified"] and keep["after"] <= 0.05 < keep["before"]
    assert (tmp_path / "out" / "repro" / "keep_in_float.onnx").is_file()
    rows = {r["tensor"]: r for r in quant["tensors"]}  # type: ignore[index]
    # One scale over the Concat's boxes and scores: the scores span < 16 steps of it.
    assert rows["y"]["kind"] == "shared scale"
    assert rows["y"]["range_lost"] == ["scores"] and rows["y"]["shared_at"] == "head_concat"
    assert rows["scores"]["kind"] == "rounding"  # its own scale is fine
    # Named as the float node whose output's quantization is at fault, not its Q/DQ nodes.
    assert report["root_cause"]["nodes"] == ["head_concat"]  # type: ignore[index]
    sensitivity = quant["sensitivity"]  # type: ignore[index]
    assert sensitivity[0]["node"] == "head_concat"
    assert "nodes_to_exclude=['head_concat']" in output
    md = (tmp_path / "out" / "report.md").read_text()
    assert md.index("## Quantization") < md.index("**Diverged.**")
    assert "`qdq.onnx` vs `float.onnx`" in md.splitlines()[0]
    assert "Report it" not in md
    html = (tmp_path / "out" / "report.html").read_text()
    assert html.index("<h2>Quantization</h2>") < html.index("<h2>Nodes")
    assert "nodes_to_exclude=[&#x27;head_concat&#x27;]" in html
    assert "<title>onnx-bisect: qdq.onnx vs float.onnx on cpu</title>" in html
    assert "<td>shared scale</td>" in html


def test_rounding_alone_is_within_quantization_error(tmp_path: Path) -> None:
    # Eight layers: a handful of nodes kept in float recovers little of what every one loses.
    src, dst = qm.quantized(qm.convnet(seed=3, layers=8), tmp_path, "qdq")
    code, report, _ = _bisect(src, dst, tmp_path / "out")
    assert code == 1
    assert not [n for n in report["nodes"] if n["verdict"] == "culprit"]  # type: ignore[union-attr]
    cause = report["root_cause"]
    assert cause["kind"] == "quantization" and not cause["nodes"]  # type: ignore[index]
    assert "within its quantization error" in cause["reason"]  # type: ignore[index]
    keep_note = report["quantization"]["keep_in_float"]  # type: ignore[index]
    assert keep_note["nodes"] == [] and keep_note["note"].startswith("within its quantization")


def test_quantize_round_trip_and_floor() -> None:
    p = QParams(np.array([0.1]), np.array([128.0]), "uint8")
    x = np.random.default_rng(0).uniform(-10, 10, 10_000)
    q = quantize(x, p)
    assert q.dtype == np.uint8
    back = dequantize(q, p)
    assert np.max(np.abs(back - x)) <= 0.05 + 1e-12
    e = quant_error(x, p)
    assert e.kind is QuantKind.ROUNDING and e.clipped == 0.0
    assert e.floor == pytest.approx(e.rel_l2, rel=0.05)  # uniform rounding, as predicted
    clipped = quant_error(x * 3, p)
    assert clipped.kind is QuantKind.CLIPPED and clipped.clipped > 0.5
    coarse = quant_error(x / 200, p)  # values within one step
    assert coarse.kind is QuantKind.COARSE


def test_the_search_stops_at_its_budget_with_the_smallest_set_seen(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two nodes of 200 needed together: ddmin needs more runs than the budget, so the answer
    is the smallest set that met the goal, said to be perhaps not the fewest."""
    monkeypatch.setattr(keep, "SEARCH_RUNS", 30)
    nodes = [f"n{i}" for i in range(200)]
    trials = keep._Trials(lambda s: 0.0 if {"n3", "n150"} <= set(s) else 1.0, 0.5)
    found, note = keep._search(nodes, [], trials)
    assert {"n3", "n150"} <= set(found) and len(found) < 200
    assert trials.runs == 30 and "perhaps not the fewest" in note
    monkeypatch.setattr(keep, "SEARCH_RUNS", 10_000)
    exact = keep._Trials(lambda s: 0.0 if {"n3", "n150"} <= set(s) else 1.0, 0.5)
    assert keep._search(nodes, [], exact) == (("n3", "n150"), "")


def test_the_default_goal_names_the_node_that_stands_out_among_hundreds() -> None:
    """The loss is one node's (n7) plus rounding spread over 300 nodes: keeping n7 in float
    recovers most of it, so the answer is that node alone, not a set of hundreds."""
    nodes = [f"n{i}" for i in range(300)]

    def error(keep: object) -> float:
        kept = set(keep)  # type: ignore[call-overload]
        return (0.0 if "n7" in kept else 0.8) + 0.2 * (1 - len(kept) / 300)

    trials = keep._Trials(error, math.inf)
    found, note, sensitivity, goal = keep._relative(trials, nodes, [], 1.0, 0.0, "e")
    assert found == ("n7",) and not note
    assert sensitivity[0].node == "n7" and "80% of the quantization loss" in goal
    assert trials.runs < 64


def test_the_default_goal_calls_spread_rounding_within_quantization_error() -> None:
    """Every node holds an equal share of the loss: no small set recovers it, so the verdict
    is the model's quantization error, with the best small set and its measured effect."""
    nodes = [f"n{i}" for i in range(300)]
    trials = keep._Trials(lambda s: 1.0 - len(set(s)) / 300, math.inf)  # type: ignore[arg-type]
    found, note, _, _ = keep._relative(trials, nodes, [], 1.0, 0.0, "e")
    assert found == ()
    assert note.startswith("within its quantization error")
    best = [f"n{i}" for i in range(8)]
    assert f"Best small set found: nodes_to_exclude={best!r}, e 1 -> 0.9733" in note


def test_the_default_goal_finds_a_few_nodes_that_recover_the_loss_together() -> None:
    """Four nodes each hold 22% of the loss: none stands out alone, the most sensitive ones
    together meet the goal, and ddmin keeps the four."""
    nodes = [f"n{i}" for i in range(300)]
    four = {"n2", "n5", "n9", "n11"}

    def error(kept: object) -> float:
        k = set(kept)  # type: ignore[call-overload]
        return 1.0 - 0.22 * len(k & four) - 0.12 * len(k - four) / 296

    trials = keep._Trials(error, math.inf)
    found, note, _, _ = keep._relative(trials, nodes, [], 1.0, 0.0, "e")
    assert set(found) == four and not note


@pytest.mark.parametrize("form", FORMS)
def test_one_quantized_model_on_two_backends_runs(tmp_path: Path, form: str) -> None:
    """An int8 model run by ONNX Runtime with and without its graph optimizations (which fuse
    Q/DQ into integer kernels): a diagnosis, not a crash."""
    _, dst = qm.quantized(qm.detector(), tmp_path, form)
    result = CliRunner().invoke(
        bisect_app,
        [str(dst), "--target", "cpu?opt=disable", "--out", str(tmp_path / "out"),
         "--format", "json", "--always-scan"],
    )  # fmt: skip
    assert result.exit_code in (0, 1), result.output
    assert "Traceback" not in result.output
    # No float model to pair with: the report says how the integers were compared.
    quant = json.loads((tmp_path / "out" / "report.json").read_text())["quantization"]
    assert quant["tensors"] == [] and quant["keep_in_float"] is None
    steps = quant["integer_steps"]
    assert steps["stepped"] > 0
    assert steps["runtime_scales"] == (steps["stepped"] if form == "dynamic" else 0)


class _NodeFault(BackendBase):
    """ONNX Runtime's CPU, except that node ``node``'s first output goes through what
    ``_fault`` adds after it (renamed ``<out>__raw`` before)."""

    def __init__(self, text: str, name: str, node: str) -> None:
        super().__init__(BackendSpec(text=text, name=name))
        self.node = node
        self.inner = create_backend("cpu")

    def _fault(self, out: str) -> list[onnx.NodeProto]:
        raise NotImplementedError

    def _run(self, model: onnx.ModelProto, feeds: Mapping[str, Any]) -> Tensors:
        m = onnx.ModelProto()
        m.CopyFrom(model)
        nodes: list[onnx.NodeProto] = []
        for n in m.graph.node:
            nodes.append(n)
            if n.name == self.node:
                nodes += self._fault(n.output[0])
                n.output[0] = f"{n.output[0]}__raw"
        del m.graph.node[:]
        m.graph.node.extend(nodes)
        return self.inner.run(m, feeds)


class StepFault(_NodeFault):
    """Quantized node ``node`` writes ``steps`` quantization steps more than it should
    (saturating): an integer kernel off by that much."""

    def __init__(self, node: str, steps: int) -> None:
        super().__init__(f"stepfault({node}+{steps})", "stepfault", node)
        self.steps = steps

    def _fault(self, out: str) -> list[onnx.NodeProto]:
        k = {"k": self.steps, "lo": 0, "hi": 255}
        nodes = [helper.make_node("Constant", [], [f"{out}__{c}"], value=helper.make_tensor(
            f"{out}__{c}", TensorProto.INT32, [], [v])) for c, v in k.items()]  # fmt: skip
        return nodes + [
            helper.make_node("Cast", [f"{out}__raw"], [f"{out}__i"], to=TensorProto.INT32),
            helper.make_node("Add", [f"{out}__i", f"{out}__k"], [f"{out}__a"]),
            helper.make_node("Clip", [f"{out}__a", f"{out}__lo", f"{out}__hi"], [f"{out}__c"]),
            helper.make_node("Cast", [f"{out}__c"], [out], to=TensorProto.UINT8),
        ]


@pytest.mark.parametrize(("steps", "verdict"), [(1, Verdict.PRECISION), (4, Verdict.CULPRIT)])
def test_one_int8_model_on_two_backends_compares_integers_in_real_units(
    tmp_path: Path, steps: int, verdict: Verdict
) -> None:
    """A QOperator model against a backend whose QLinearSigmoid writes ``steps`` too many:
    one step is two int8 kernels rounding apart (precision, no culprit); four is a kernel
    bug, found at that node."""
    _, dst = qm.quantized(qm.detector(), tmp_path, "qoperator")
    result = onnx_bisect.bisect(
        str(dst), target=StepFault("score_sigmoid_quant", steps), always_scan=True
    )
    by_name = {n.name: n.verdict for n in result.nodes}
    assert by_name["score_sigmoid_quant"] is verdict
    culprits = [n for n, v in by_name.items() if v is Verdict.CULPRIT]
    if verdict is Verdict.CULPRIT:
        assert result.root_cause is not None
        assert result.root_cause.nodes == ("score_sigmoid_quant",)
        assert culprits == ["score_sigmoid_quant"]
    else:
        assert not culprits


class AccFault(_NodeFault):
    """Integer node ``node`` writes its int32 accumulator ``1 + rel`` times too large: a
    kernel off by more than any rounding."""

    def __init__(self, node: str, rel: float) -> None:
        super().__init__(f"accfault({node}*{1 + rel})", "accfault", node)
        self.rel = rel

    def _fault(self, out: str) -> list[onnx.NodeProto]:
        k = helper.make_tensor(f"{out}__k", TensorProto.FLOAT, [], [1 + self.rel])
        return [
            helper.make_node("Constant", [], [f"{out}__k"], value=k),
            helper.make_node("Cast", [f"{out}__raw"], [f"{out}__f"], to=TensorProto.FLOAT),
            helper.make_node("Mul", [f"{out}__f", f"{out}__k"], [f"{out}__m"]),
            helper.make_node("Cast", [f"{out}__m"], [out], to=TensorProto.INT32),
        ]


def test_the_per_tensor_table_is_built_while_the_float64_oracle_measures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The table needs the reference's values and the scales, not the criterion: it is built
    inside the screen, before its wait for the float64 oracle, and it is the table the report
    has. The oracle is held 2 s here, so that what is tested does not depend on how fast the
    machine imports torch."""
    monkeypatch.setattr(diagnose, "measure_float64", SlowOracle(2.0))
    src, dst = qm.quantized(qm.detector(), tmp_path, "qdq")
    result = onnx_bisect.bisect(str(src), target="cpu", target_model=str(dst))
    note = next(n for n in result.notes if n.startswith("per-tensor quantization table"))
    ready = float(note.split("ready ")[1].split(" s ")[0])
    timings = result.timings
    assert timings["float64"] >= 2.0  # the oracle was still measuring ...
    assert ready < timings["load"] + 2.0  # ... when the table was ready
    assert ready <= timings["load"] + timings["screen"] + 0.05
    assert result.quant is not None and f"{len(result.quant.rows)} tensors" in note


@pytest.mark.parametrize(("budget", "early"), [(270 << 10, False), (4 << 30, True)])
def test_the_early_scan_waits_for_the_oracle_where_the_budget_cannot_hold_both(
    tmp_path: Path, budget: int, early: bool
) -> None:
    """A quantized target's reference scan is done while the float64 oracle measures only
    where the budget holds both: at 270 KB the oracle runs alongside (every probe in one
    float64 run) but a scan of every probe beside it would take the plan past the budget."""
    from onnx_bisect.engine.diagnose import open_session, prepare
    from onnx_bisect.engine.quant.prelude import prepare_early
    from onnx_bisect.engine.session import StageTimer
    from onnx_bisect.options import BisectOptions

    src, dst = qm.quantized(qm.detector(), tmp_path, "qdq")
    options = BisectOptions(max_memory=budget, target_model=str(dst))
    timer = StageTimer()
    setup, feeds = prepare(str(src), "cpu", "cpu", options, timer)
    session = open_session(setup, feeds, tmp_path / "scratch", timer)
    try:
        m = session.memory
        assert m.oracle_beside(True) == 2  # the oracle measures alongside at both budgets
        prepare_early(session)
        assert bool(session.early) is early
        if not early:
            assert 2 * (m.probes + m.working) <= m.free < 3 * (m.probes + m.working)
    finally:
        session.abandon()


# A runtime that answers every output it is asked for but the run-time scales (one that
# folds them into its kernels, say): onnxruntime's run, those left out of its .npz.
_NO_SCALES = """
import sys
import numpy as np
import onnxruntime as ort
model, inputs, outputs = sys.argv[1:4]
s = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
names = [o.name for o in s.get_outputs()]
values = s.run(names, dict(np.load(inputs)))
np.savez(outputs, **{n: v for n, v in zip(names, values) if "scale" not in n})
"""


def test_a_dynamic_target_that_returns_no_run_time_scales_is_still_diagnosed(
    tmp_path: Path,
) -> None:
    """Its integers cannot be read in real units: each is listed unpaired with why, and the
    diagnosis goes on (it was exit 3, KeyError: a Gemm's result before its bias, which has no
    float counterpart of its name, paired with a value computed from the missing run)."""
    import sys

    rng = np.random.default_rng(0)
    weights = [
        helper.make_tensor(n, TensorProto.FLOAT, shape, rng.standard_normal(shape).ravel() / 4)
        for n, shape in (("W1", [16, 16]), ("b1", [16]), ("W2", [16, 8]), ("b2", [8]))
    ]
    nodes = [  # Gemms: quantize_dynamic splits each into MatMulInteger... -> Add of the bias
        helper.make_node("Gemm", ["x", "W1", "b1"], ["a1"], name="fc1"),
        helper.make_node("Relu", ["a1"], ["r1"], name="relu"),
        helper.make_node("Gemm", ["r1", "W2", "b2"], ["y"], name="fc2"),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])
    src, dst = qm.quantized(make(nodes, [x], [y], weights), tmp_path, "dynamic")
    runtime = tmp_path / "no_scales.py"
    runtime.write_text(_NO_SCALES)
    out = tmp_path / "out"
    target = f"exec:{sys.executable} {runtime} {{model}} {{inputs}} {{outputs}}"
    result = CliRunner().invoke(
        bisect_app,
        [str(src), "--target-model", str(dst), "--target", target, "--out", str(out),
         "--format", "json"],
    )  # fmt: skip
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    assert result.exit_code == 1, result.output
    quant = json.loads((out / "report.json").read_text())["quantization"]
    why = {u["tensor"]: u["reason"] for u in quant["unpaired"]}
    unread = [t for t, reason in why.items() if "could not be read" in reason]
    assert unread and all("did not return" in why[t] for t in unread)
    # Only what needs no scale is paired: the float result after the bias Add.
    assert not [rule for rule in quant["paired_by_rule"] if "run-time" in rule]
