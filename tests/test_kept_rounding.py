"""The float16 floor of a ``+fp16`` target counts the rounding the conversion applies before a
node it kept in float32 (zoo H11: tashkeel-bilstm-int8's DynamicQuantizeLSTMs quantize their
float16-rounded inputs at run time, which flips int8 steps the faithful twin does not count)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnx_bisect import BisectOptions
from onnx_bisect.compare.precision import Precision, PrecisionFloors
from onnx_bisect.compare.tensors import compare_tensors
from onnx_bisect.engine.diagnose import open_session, prepare, screen_session
from onnx_bisect.engine.measure.observe import Observed
from onnx_bisect.engine.precision import with_input_rounding
from onnx_bisect.engine.session import StageTimer, scratch_dir
from tests.quant_models import LSTM_SHAPE, lstm, quantized


def embedded_lstm(tmp: Path) -> onnx.ModelProto:
    """ids -> Gather(table) -> DynamicQuantizeLSTM -> y: integer inputs (nothing for the model
    inputs' rounding to move), and an LSTM that +fp16 keeps in float32 behind a Cast from the
    float16 Gather."""
    _, path = quantized(lstm(), tmp, "dynamic", op_types_to_quantize=["LSTM"])
    model = onnx.load(str(path))
    seq, batch, width = LSTM_SHAPE
    table = np.random.default_rng(1).random((50, width)).astype(np.float32)
    g = model.graph
    g.initializer.append(numpy_helper.from_array(table, "table"))
    g.node.insert(0, helper.make_node("Gather", ["table", "ids"], ["x"], name="embed"))
    del g.input[:]
    g.input.append(helper.make_tensor_value_info("ids", TensorProto.INT64, [seq, batch]))
    return model


def _judged(tmp: Path, fault: float) -> tuple[Observed, Observed, list[str]]:
    """The screened outcome under a floor as small as the twin's on tashkeel (1.6e-4 against
    a response of 0.0086), with the target's output scaled by ``fault``, and judged again."""
    timer = StageTimer()
    options = BisectOptions(threshold=1e-5)
    setup, feeds = prepare(embedded_lstm(tmp), "cpu", "cpu+fp16", options, timer)
    with scratch_dir() as scratch:
        session = open_session(setup, feeds, scratch, timer)
        (out,) = session.loaded.outputs
        small = PrecisionFloors(Precision.FLOAT16, accumulated={out: 1e-6})
        session.crit = replace(session.crit, floors=small)
        screened = screen_session(session)
        assert isinstance(screened, Observed)
        moved = {out: screened.target_outputs[out] * fault}
        got = compare_tensors(out, screened.ref_outputs[out], moved[out], session.crit)
        screened = replace(screened, target_outputs=moved, comparisons={out: got})
        return screened, with_input_rounding(session, screened), session.notes


def test_rounding_before_a_kept_dynamic_int8_node_is_float16s_own(tmp_path: Path) -> None:
    """The target's error is all the float16 rounding of the DynamicQuantizeLSTM's input: past
    the small floor (exit 1, root none before), within it once the reference run rounds that
    input too, with a note that names it."""
    screened, judged, notes = _judged(tmp_path, 1.0)
    assert screened.diverged
    assert not judged.diverged  # exit 0
    (c,) = judged.comparisons.values()
    assert c.within_precision
    assert notes[-1].startswith(
        "the outputs' float16 floors count the 1 float32-kept node input's own rounding to "
        "float16 (the reference run on rounded 1 float32-kept node input moves y "
    ), notes[-1]


def test_a_fault_past_that_rounding_still_diverges(tmp_path: Path) -> None:
    """A target 2% off besides (a planted fault) is still past the raised floor: the extra
    run counts the rounding, not whatever the target did."""
    _, judged, _ = _judged(tmp_path, 1.02)
    assert judged.diverged
