"""The quantization verdicts' two acquittals (pure): a data-movement op on the integers is its
input's rounding, and beside a verified keep-in-float set a culprit that alone recovers none of
the loss is rounding too, so the root cause is the set's node, not a list of suspects (YOLOv8n
QOperator named a Split, a Sigmoid and a dfl Conv beside the Concat whose shared scale was the
fault)."""

from __future__ import annotations

from onnx_bisect.compare.criterion import Comparison, Status
from onnx_bisect.compare.quant import QuantError
from onnx_bisect.engine.quant.conclude import _acquit
from onnx_bisect.engine.quant.verdicts import quant_cause, requalify
from onnx_bisect.quant_result import KeepInFloat, QuantRow, Sensitivity
from onnx_bisect.result import CauseKind, NodeResult, Verdict

ROUNDING = QuantError(rel_l2=0.01, sqnr_db=40.0, clipped=0.0, levels=200.0, floor=0.01)


def _node(name: str, op: str, iso: float, note: str = "") -> NodeResult:
    comparison = Comparison(f"{name}_out", Status.DIVERGED, iso, {"rel_l2": iso})
    return NodeResult(
        0, name, op, (f"{name}_in",), (f"{name}_out",), Verdict.CULPRIT, comparison, comparison,
        note=note,
    )  # fmt: skip


def _row(name: str) -> QuantRow:
    return QuantRow(f"{name}_out", f"{name}_q", "uint8 scale 0.03", ROUNDING)


def test_a_split_on_the_integers_is_its_inputs_rounding_however_large_a_slices_error() -> None:
    split, conv = _node("split", "Split", 0.05), _node("conv", "Conv", 0.05)
    judged = requalify([split, conv], {}, [_row("split"), _row("conv")], {})
    assert judged[0].verdict is Verdict.PRECISION and "as they are" in judged[0].note
    assert judged[1].verdict is Verdict.CULPRIT  # a computing node over its budget stays one


def test_beside_a_verified_set_a_culprit_that_recovers_nothing_is_acquitted() -> None:
    q = "quantization (uint8 scale 0.03): isolated error 0.05 exceeds the 0.04 ..."
    nodes = [_node("concat", "Concat", 0.3, q), _node("dfl", "Conv", 0.05, q),
             _node("act", "Sigmoid", 0.06, q)]  # fmt: skip
    keep = KeepInFloat(("concat",), "goal", before=0.5, after=0.1, verified=True, runs=9)
    measured = [Sensitivity("concat", 0.25), Sensitivity("dfl", 0.5001), Sensitivity("act", 0.3)]
    judged = list(_acquit(nodes, {}, measured, keep))
    assert [n.verdict for n in judged] == [Verdict.CULPRIT, Verdict.PRECISION, Verdict.CULPRIT]
    assert "meets the goal without it" in judged[1].note
    # "act" alone recovers half the loss: a real suspect, still named.
    cause = quant_cause(judged, None, [])
    assert cause is not None and cause.kind is CauseKind.QUANTIZATION
    assert cause.nodes == ("concat", "act")


def test_without_a_verified_set_no_culprit_is_acquitted_by_the_set_rule() -> None:
    q = "quantization (uint8 scale 0.03): isolated error 0.05 exceeds the 0.04 ..."
    keep = KeepInFloat((), "goal", before=0.5, after=0.5, verified=False, runs=9, note="none")
    judged = list(_acquit([_node("dfl", "Conv", 0.05, q)], {}, [Sensitivity("dfl", 0.5)], keep))
    assert judged[0].verdict is Verdict.CULPRIT
