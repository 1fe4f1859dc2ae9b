"""A node that fails in the model but runs alone, fed the reference's inputs, is fed a tensor
whose rank or type the target lost upstream: the failure search names the node that lost it
(from the target's static view of the graph), and keeps the failing node in the reason, in
``fails_at`` and in its row. silero-vad on OpenVINO is the measured case (its Conv refused for
an input of unknown rank that an If with branches of two ranks gives)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
import pytest
from typer.testing import CliRunner

import onnx_bisect
from onnx_bisect.backends.protocol import BackendBase, Tensors
from onnx_bisect.backends.registry import create_backend
from onnx_bisect.backends.spec import BackendSpec
from onnx_bisect.backends.static_view import StaticType
from onnx_bisect.cli import bisect_app
from onnx_bisect.engine.search.typeloss import lost_type, walk_loss
from onnx_bisect.graph.load import load_model
from onnx_bisect.result import CauseKind, Verdict
from tests.models import chain, squeeze_if_conv

F32 = np.dtype(np.float32)
CONV_SAID = "The input data tensor's rank has to be known (static)"
REASON = (
    "as it reads the model, before any run, the target loses the rank of If 'squeeze_if' "
    "output 'b': it types it f32 [...] where the reference's value has rank 2 (4, 5), and "
    "types every input of that If right; Conv 'conv' reads that tensor through Unsqueeze "
    "'unsqueeze' and is where the target gives up: it cannot run it whenever the node is in "
    "the model and runs every smaller prefix of the graph; fed the reference's inputs it runs "
    "alone, and fails alone once that input is declared as the target types it"
)


def test_a_static_type_is_judged_against_the_references_value() -> None:
    subject = "If 'i' output 'b'"
    assert lost_type(StaticType(F32, None, "f32 [...]"), F32, (1, 128), subject) == (
        "loses the rank of If 'i' output 'b': it types it f32 [...] where the reference's "
        "value has rank 2 (1, 128)"
    )
    assert lost_type(
        StaticType(np.dtype(np.float64), (None, None), "?,?,f64"), F32, (4, 3), subject
    ) == ("types If 'i' output 'b' as float64 (?,?,f64) where the model says float32")
    assert lost_type(StaticType(F32, (4,), "f32 [4]"), F32, (1, 4), subject) == (
        "types If 'i' output 'b' as f32 [4] where the reference's value has rank 2 (1, 4)"
    )
    assert lost_type(StaticType(F32, (2, 8), "f32 [2,8]"), F32, (1, 8), subject) == (
        "types If 'i' output 'b' as f32 [2,8] where the reference's value has rank 2 (1, 8)"
    )
    # Unknown sizes fit any; integer widths and one element as a scalar are not counted.
    assert lost_type(StaticType(F32, (None, 128), "f32 [?,128]"), F32, (1, 128), subject) is None
    i32, i64 = np.dtype(np.int32), np.dtype(np.int64)
    assert lost_type(StaticType(i32, (3,), "i32 [3]"), i64, (3,), subject) is None
    assert lost_type(StaticType(F32, (1,), "f32 [1]"), F32, (), subject) is None


def test_the_walk_names_the_first_node_whose_inputs_are_typed_right() -> None:
    """mm0 -> act0 -> mm1 -> act1 -> mm2 -> act2: the target loses the rank of h1 (mm1's
    output) and passes the loss on through act1 to mm2, which fails."""
    loaded = load_model(chain(3))
    nodes = {n.name: n for n in loaded.nodes}
    lost = {"h1", "a1"}

    def words(tensor: str) -> str | None:
        return f"loses {tensor}" if tensor in lost else None

    loss = walk_loss(loaded, nodes["mm2"], words)
    assert loss is not None
    assert (loss.node.name, loss.tensor, loss.words) == ("mm1", "h1", "loses h1")
    assert [n.name for n in loss.path] == ["mm1", "act1"]
    # A failing node that reads nothing typed wrong: nothing to name upstream.
    assert walk_loss(loaded, nodes["mm1"], words) is None
    assert walk_loss(loaded, nodes["act0"], words) is None


class RankLosing(BackendBase):
    """ORT CPU whose static view types ``h1`` and ``a1`` of ``chain(3)`` with no rank, and
    that refuses ``mm2`` whenever its input ``a1`` is computed in the model (as OpenVINO
    refuses a Conv fed an If's rank-less output) or, with ``rankless``, declared with no rank."""

    def __init__(self, *, rankless: bool) -> None:
        super().__init__(BackendSpec(text="rank-losing", name="rank-losing"))
        self.rankless, self.inner = rankless, create_backend("cpu")

    def _run(self, model: onnx.ModelProto, feeds: Mapping[str, npt.NDArray[Any]]) -> Tensors:
        node = next((n for n in model.graph.node if n.name == "mm2"), None)
        if node is not None:
            made = {o for n in model.graph.node for o in n.output}
            declared = {i.name: i for i in model.graph.input}
            operand = node.input[0]
            shapeless = operand in declared and not declared[operand].type.tensor_type.HasField(
                "shape"
            )
            if operand in made or (self.rankless and shapeless):
                raise RuntimeError("mm2: the input's rank has to be known (static)")
        return self.inner.run(model, feeds)

    def static_types(
        self, model: onnx.ModelProto, feeds: Mapping[str, npt.NDArray[Any]]
    ) -> dict[str, StaticType]:
        lost = {"h1", "a1"}
        return {
            o.name: StaticType(F32, None if o.name in lost else (1, 8), "?")
            for o in model.graph.output
        }


def test_a_loss_the_failing_node_alone_confirms_is_named_and_one_it_does_not_is_not() -> None:
    """Where the failing node alone, its input declared with no rank, fails too, the node
    that lost the rank is named; where it runs, the rank is not what it fails on, and the
    failing node is named as before ("needs the graph before it")."""
    named = onnx_bisect.bisect(
        chain(3), target=RankLosing(rankless=True), threshold=1e-3, repro=None
    )
    cause = named.root_cause
    assert cause is not None and cause.nodes == ("mm1",) and cause.fails_at == "mm2", cause
    assert cause.kind is CauseKind.ERROR
    assert cause.reason.startswith(
        "as it reads the model, before any run, the target loses the rank of MatMul 'mm1' "
        "output 'h1': it types it ? where the reference's value has rank 2 (1, 8), and types "
        "every input of that MatMul right; MatMul 'mm2' reads that tensor through Tanh 'act1'"
    )
    assert cause.reason.endswith("once that input is declared as the target types it")
    kept = onnx_bisect.bisect(
        chain(3), target=RankLosing(rankless=False), threshold=1e-3, repro=None
    )
    cause = kept.root_cause
    assert cause is not None and cause.nodes == ("mm2",) and cause.fails_at == "", cause
    assert "needs the graph before it" in cause.reason


def test_tract_types_a_constant_of_shape_without_value_float64() -> None:
    """tract's analysed facts are its static view: the ConstantOfShape it makes float64."""
    pytest.importorskip("tract")
    from onnx_bisect.backends.registry import create_backend
    from onnx_bisect.backends.spec import parse_spec
    from onnx_bisect.backends.static_view import static_types
    from onnx_bisect.backends.tract import parse_fact
    from onnx_bisect.graph.extract import prefix_model
    from tests.test_failures import constant_of_shape_gemm

    assert parse_fact("1,?,N,f32") == StaticType(F32, (1, None, None), "1,?,N,f32")
    assert parse_fact("..,?") == StaticType(None, None, "..,?")
    loaded = load_model(constant_of_shape_gemm())
    model = prefix_model(loaded, 2, outputs=["r", "zeros"])
    feeds = {"x": np.ones((2, 4), np.float32)}
    view = static_types(create_backend(parse_spec("tract")), model, feeds)
    assert view == {
        "r": StaticType(F32, (2, 4), "2,4,f32"),
        "zeros": StaticType(np.dtype(np.float64), (4, 3), "4,3,f64"),
    }


def test_openvino_loses_the_rank_at_the_if_and_the_if_is_named() -> None:
    """Real OpenVINO: the Conv is refused, runs alone, and its input's rank is lost at the If
    (its branches give rank 2 and rank 3): the If is named, the Conv is where it fails."""
    pytest.importorskip("openvino")
    result = onnx_bisect.bisect(
        squeeze_if_conv(), target="openvino?precision=f32", shapes={"x": (1, 4, 5)},
        threshold=1e-3, repro=None,
    )  # fmt: skip
    cause = result.root_cause
    assert cause is not None and cause.nodes == ("squeeze_if",), cause
    assert cause.kind is CauseKind.UNSUPPORTED and cause.fails_at == "conv"
    assert cause.reason == REASON
    assert CONV_SAID in cause.message and "Conv-18" in cause.message
    verdicts = {n.name: (n.verdict, n.note) for n in result.nodes}
    assert verdicts["squeeze_if"][0] is Verdict.FAILED
    assert verdicts["conv"] == (Verdict.UNSUPPORTED, cause.message)
    assert result.first_divergence is not None and result.first_divergence.name == "squeeze_if"


def test_the_cli_report_names_the_if_and_where_it_fails(tmp_path: Path) -> None:
    """report.json says both: the node named and ``fails_at``; the bundle reproduces."""
    pytest.importorskip("openvino")
    model = tmp_path / "m.onnx"
    model.write_bytes(squeeze_if_conv().SerializeToString())
    out = tmp_path / "r"
    args = [str(model), "--target", "openvino?precision=f32", "--shape", "x=1x4x5"]
    res = CliRunner().invoke(bisect_app, [*args, "--threshold", "1e-3", "-o", str(out)])
    assert res.exit_code == 1, res.output
    cause = json.loads((out / "report.json").read_text())["root_cause"]
    assert cause["nodes"] == ["squeeze_if"] and cause["fails_at"] == "conv"
    assert cause["kind"] == "unsupported" and cause["reason"] == REASON
    assert "Root cause (unsupported): squeeze_if" in " ".join(res.output.split())
    repro = json.loads((out / "report.json").read_text())["repro"]
    assert repro["kind"] == "error" and repro["reproduces"] and "conv" in repro["nodes"]
    title = (out / "repro" / "issue.md").read_text().splitlines()[0]
    assert title.endswith("loses the type of `squeeze_if`'s output and cannot run `conv`"), title
