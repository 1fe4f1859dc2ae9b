"""--topk: task-level label agreement on final outputs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from typer.testing import CliRunner

import onnx_bisect
from onnx_bisect.cli import bisect_app
from onnx_bisect.compare.topk import TopKSpec, parse_topk, topk_check
from onnx_bisect.errors import InputError
from tests.faulty import FaultyBackend
from tests.models import YOLO, make


def test_parse() -> None:
    assert parse_topk("5") == TopKSpec(5)
    assert parse_topk("5:logits") == TopKSpec(5, "logits")
    assert parse_topk("1:output0@1[4:]") == TopKSpec(1, "output0", 1, 4, None)
    assert parse_topk("3:out@-1[:-2]").stop == -2
    assert parse_topk("1:output0@1[4:]").text == "1:output0@1[4:]"
    for bad in ("0", "x", "5:", "5:a@b", "5:a[1]"):
        with pytest.raises(InputError):
            parse_topk(bad)


def test_labels_that_flip_are_counted_and_listed() -> None:
    ref = np.array([[0.1, 0.7, 0.2], [0.5, 0.3, 0.2], [0.2, 0.2, 0.6], [0.0, 0.1, 0.9]])
    target = ref.copy()
    target[1] = [0.3, 0.5, 0.2]  # top-1 flips 0 -> 1, top-2 set unchanged
    target[3] = [0.5, 0.1, 0.4]  # top-1 flips 2 -> 0, and label 1 leaves the top-2
    top1 = topk_check("p", TopKSpec(1, "p"), ref, target)
    assert top1.top1_agreement == 0.5 and top1.rows_changed == 2
    assert [(c.row, c.ref_label, c.target_label) for c in top1.changed] == [
        ((1,), 0, 1),
        ((3,), 2, 0),
    ]
    assert top1.strongest_flip == 0.9  # row 3's reference top-1 score
    assert "strongest flipped row's reference score: 0.9" in top1.summary()
    top2 = topk_check("p", TopKSpec(2, "p"), ref, target)
    assert top2.rows_changed == 1 and top2.topk_overlap == pytest.approx(7 / 8)
    assert not top2.agrees


def test_a_detector_head_axis_and_slice() -> None:
    """[batch, 4 box + 3 class, anchors]: classes along axis 1 from row 4; labels count from
    the slice's start, so they are the output's own channel indices."""
    rng = np.random.default_rng(0)
    ref = rng.random((1, 7, 6))
    target = ref.copy()
    target[0, 0:4] += 100.0  # box coordinates change a lot: not labels
    anchor = 2
    best = int(np.argmax(ref[0, 4:, anchor]))
    other = (best + 1) % 3
    target[0, 4 + other, anchor] = ref[0, 4 + best, anchor] + 1.0
    check = topk_check("output0", parse_topk("1:output0@1[4:]"), ref, target)
    assert check.rows == 6 and check.rows_changed == 1
    assert check.changed[0].row == (0, anchor)
    assert (check.changed[0].ref_label, check.changed[0].target_label) == (4 + best, 4 + other)


def test_errors() -> None:
    a = np.zeros((2, 3))
    with pytest.raises(InputError, match="only 3 label"):
        topk_check("a", TopKSpec(5, "a"), a, a)
    with pytest.raises(InputError, match="shape"):
        topk_check("a", TopKSpec(1, "a"), a, np.zeros((3, 2)))


def _classifier(batch: int = 64) -> object:
    """x [batch, 8] -> Gemm -> logits [batch, 10]."""
    rng = np.random.default_rng(1)
    w = numpy_helper.from_array(rng.standard_normal((8, 10)).astype(np.float32), "W")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 8])
    y = helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, 10])
    gemm = helper.make_node("Gemm", ["x", "W"], ["hidden"], name="fc")
    relu = helper.make_node("Relu", ["hidden"], ["logits"], name="relu")
    return make([gemm, relu], [x], [y], [w])


def test_bisect_reports_label_agreement_for_a_planted_fault() -> None:
    model = _classifier()
    clean = onnx_bisect.bisect(model, target="cpu", topk=["1:logits", "5:logits"])
    assert [c.rows_changed for c in clean.task_checks] == [0, 0]
    # A 30% error at the Gemm scales every logit alike: the numbers diverge, labels hold.
    faulty = onnx_bisect.bisect(model, target=FaultyBackend("fc", 0.3), topk=["1:logits"])
    assert faulty.verdict == "diverged"
    assert faulty.task_checks[0].top1_agreement == 1.0
    assert onnx_bisect.to_dict(faulty)["task_checks"][0]["rows"] == 64


def test_cli_topk(tmp_path: Path) -> None:
    runner = CliRunner()
    res = runner.invoke(
        bisect_app,
        [str(YOLO), "-t", "cpu", "--topk", "5:output0@1[4:]", "-o", str(tmp_path / "r")],
    )
    assert res.exit_code == 0, res.output
    assert "task check: output0 top-5" in res.stdout
    data = json.loads((tmp_path / "r" / "report.json").read_text())
    assert data["task_checks"][0]["top1_agreement"] == 1.0
    assert "**Task-level check**" in (tmp_path / "r" / "report.md").read_text()
    bad = runner.invoke(bisect_app, [str(YOLO), "-t", "cpu", "--topk", "5:nope"])
    assert bad.exit_code == 2 and "no output 'nope'" in bad.output
