"""LLM goals for the keep searches: ``--quant-goal`` as top-1 token agreement or the last
position's logit error, measured on every prompt of ``--dataset``, the answer verified on all
of them and reported per prompt; and keep-in-fp32 for a torch target computing in float16."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from typer.testing import CliRunner

from onnx_bisect.cli import bisect_app
from onnx_bisect.compare.goal import QuantGoal, parse_goal
from onnx_bisect.errors import InputError
from tests import fp16_models as fm

PROMPTS = [f"prompts/prompt{i}.npz" for i in range(8)]


def _bisect(tmp: Path, model: onnx.ModelProto, *args: str) -> tuple[int, str, dict[str, Any]]:
    path = tmp / "model.onnx"
    onnx.save(model, str(path))
    fm.prompts(tmp / "prompts")
    out = tmp / "out"
    res = CliRunner().invoke(
        bisect_app,
        [str(path), "--dataset", str(tmp / "prompts"), "--no-repro", "--out", str(out), *args],
    )
    assert "Traceback" not in res.output, res.output
    report = json.loads((out / "report.json").read_text()) if res.exit_code in (0, 1) else {}
    return res.exit_code, " ".join(res.output.split()), report


def _labels(keep: dict[str, Any], tmp: Path) -> list[str]:
    return [str(Path(f["input"]).relative_to(tmp)) for f in keep["per_input"]]


def _logits(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return np.asarray(sess.run(None, feeds)[0])


def _feeds(tmp: Path) -> list[dict[str, np.ndarray]]:
    return [dict(np.load(tmp / p)) for p in PROMPTS]


def test_the_goal_grammar_and_its_figures() -> None:
    top1 = parse_goal("top1:logits@last>=100%")
    assert top1 == QuantGoal("top1", 1.0, "logits", last=True)
    assert top1.text == "top1:logits@last>=1" and top1.limit == 0.0
    assert top1.describe(8) == (
        "top-1 agreement of logits at the last position >= 100.00% on every one of 8 inputs "
        "(--quant-goal)"
    )
    assert parse_goal("rel_l2<=1e-2") == QuantGoal("rel_l2", 0.01)
    assert parse_goal("0.03") == parse_goal(0.03) == QuantGoal("error", 0.03)
    assert parse_goal("top1 >= 0.9").bound == 0.9
    for bad, why in [
        ("top1<=1", "expected X, top1[:OUTPUT][@last]>=P or rel_l2[:OUTPUT][@last]<=X"),
        ("rel_l2>=0.1", "expected X, top1[:OUTPUT][@last]>=P"),
        ("top1>=120%", "an agreement in (0, 1]"),
        ("-1", "quant_goal must be a positive number"),
    ]:
        with pytest.raises(InputError, match=re.escape(why)):
            parse_goal(bad)
    # [1, 3 positions, 4 labels]: the target flips the first position's best label only.
    ref = np.array([[[0, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 1]]], np.float32)
    got = ref.copy()
    got[0, 0] = [0, 0, 2, 0]
    assert parse_goal("top1>=1").figure({"y": ref}, {"y": got}) == pytest.approx(2 / 3)
    assert parse_goal("top1@last>=1").figure({"y": ref}, {"y": got}) == 1.0
    assert parse_goal("rel_l2:y@last<=1").figure({"y": ref}, {"y": got}) == 0.0
    assert parse_goal("rel_l2<=1").figure({"y": ref}, {"y": got}) == pytest.approx(
        np.linalg.norm(got - ref) / np.linalg.norm(ref)
    )
    assert parse_goal("top1>=1").figure({"y": ref}, {}) == 0.0  # an output missing


def test_a_goal_of_the_wrong_form_is_a_usage_error(tmp_path: Path) -> None:
    code, text, _ = _bisect(tmp_path, fm.token_overflow(), "-t", "cpu+fp16", "--quant-goal",
                            "top1:logits<=1")  # fmt: skip
    assert code == 2
    assert text == (
        "error: --quant-goal 'top1:logits<=1': expected X, top1[:OUTPUT][@last]>=P or "
        "rel_l2[:OUTPUT][@last]<=X, e.g. 0.01, 'top1>=100%' or 'rel_l2:logits@last<=1e-2'"
    )


@pytest.mark.slow
def test_an_fp16_overflow_is_kept_in_float32_for_top1_on_every_prompt(tmp_path: Path) -> None:
    model = fm.token_overflow()
    code, text, report = _bisect(
        tmp_path, model, "-t", "cpu+fp16", "--quant-goal", "top1:logits@last>=100%"
    )
    assert code == 1, text
    keep = report["keep_in_fp32"]
    assert keep["nodes"] == [fm.UP] and keep["verified"] is True
    assert keep["goal"] == (
        "top-1 agreement of logits at the last position >= 100.00% on every one of 8 inputs "
        "(--quant-goal)"
    )
    assert keep["figure"] == "top-1 agreement of logits at the last position"
    assert keep["before"] == 0.0 and keep["after"] == 1.0
    assert sorted(_labels(keep, tmp_path)) == PROMPTS
    assert [(f["before"], f["after"], f["met"]) for f in keep["per_input"]] == [
        (0.0, 1.0, True)
    ] * 8
    assert (
        "top-1 agreement of logits at the last position per input, before -> with the set "
        "(8 of 8 meet the goal):" in text
    )
    assert f"{tmp_path}/prompts/prompt0.npz: 0 -> 1" in text
    md = (tmp_path / "out" / "report.md").read_text()
    assert "| input | top-1 agreement of logits at the last position | with the set |" in md
    # Applied as printed, by onnxconverter-common: every prompt's next token is the float
    # model's again (and without the set, none is).
    from onnxconverter_common import float16

    kept = eval(keep["call"], {"float16": float16, "model": model})  # noqa: S307
    plain = float16.convert_float_to_float16(model, keep_io_types=True)
    for feeds in _feeds(tmp_path):
        ref = _logits(model, feeds)[0, -1]
        assert _logits(kept, feeds)[0, -1].argmax() == ref.argmax()
        assert np.isnan(_logits(plain, feeds)).all()


@pytest.mark.slow
def test_a_torch_float16_target_keeps_modules_in_float32_on_every_prompt(
    tmp_path: Path,
) -> None:
    """dtype=float16 computes every node in float16: keeping the MatMul in float32 is not
    enough (its reader casts the 1e5 back to float16), so its bias Add and the LayerNorm
    stay in float32 with it; the modules they come from are the autocast answer."""
    target = "torch:cpu?dtype=float16"
    code, text, report = _bisect(
        tmp_path, fm.token_overflow(), "-t", target, "--quant-goal", "rel_l2:logits@last<=1e-2"
    )
    assert code == 1, text
    keep = report["keep_in_fp32"]
    assert keep["nodes"] == [fm.UP, fm.UP_BIAS, fm.NORM] and keep["verified"] is True
    assert keep["modules"] == ["model.up_proj", "model.norm"]
    assert keep["goal"] == (
        "rel_l2 of logits at the last position <= 0.01 on every one of 8 inputs (--quant-goal)"
    )
    assert keep["verified_by"] == (
        "running it on the target with the set in float32 (torch:cpu?dtype=float16, these "
        "nodes' operands cast to float32 and their readers' back, as autocast does for a "
        "module excluded from it)"
    )
    assert keep["note"] == (
        "as a node_block_list, converted by onnxconverter-common and run on the reference "
        "(onnxruntime CPUExecutionProvider opt=all), it meets the goal on 8 of 8 inputs"
    )
    assert sorted(_labels(keep, tmp_path)) == PROMPTS
    assert all(f["before"] == "inf" and f["after"] < 1e-2 and f["met"] for f in keep["per_input"])
    assert "modules to keep in float32: model.up_proj, model.norm" in text
    # The torch backend told to keep them computes each prompt within the goal; with one of
    # the three left out, the overflow comes back.
    from onnx_bisect.backends.registry import create_backend
    from onnx_bisect.backends.torch.options import with_float32_nodes

    torch16 = create_backend(target)
    model = fm.token_overflow()
    for feeds in _feeds(tmp_path):
        ref = _logits(model, feeds)[0, -1]
        got = torch16.run(with_float32_nodes(model, keep["nodes"]), feeds)["logits"][0, -1]
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) <= 1e-2
        short = torch16.run(with_float32_nodes(model, [fm.UP, fm.UP_BIAS]), feeds)["logits"]
        assert np.isnan(short).all()


@pytest.mark.slow
def test_a_model_float16_runs_fine_gets_no_set_over_the_prompts(tmp_path: Path) -> None:
    code, text, report = _bisect(
        tmp_path, fm.token_overflow(scale=1.0), "-t", "torch:cpu?dtype=float16",
        "--quant-goal", "top1:logits@last>=100%",
    )  # fmt: skip
    assert code == 0, text
    assert report["keep_in_fp32"] is None and "Keep in float32" not in text


@pytest.mark.slow
def test_an_int4_outlier_channel_is_kept_in_float_for_top1_on_every_input(
    tmp_path: Path,
) -> None:
    """The keep-in-float search with a task goal: top-1 agreement at every position >= 90%
    on each of 8 inputs, verified by re-quantizing with the set excluded."""
    pytest.importorskip("onnxruntime.quantization.matmul_nbits_quantizer")
    from tests import quant_models as qm

    src, dst = qm.int4(qm.outlier_mlp(), tmp_path)
    data = tmp_path / "inputs"
    data.mkdir()
    for i in range(8):
        x = np.random.default_rng(300 + i).random(qm.MLP_SHAPE).astype(np.float32)
        np.savez(data / f"x{i}.npz", x=x)
    out = tmp_path / "out"
    res = CliRunner().invoke(
        bisect_app,
        [str(src), "--target-model", str(dst), "-t", "cpu", "--dataset", str(data),
         "--quant-goal", "top1:logits>=90%", "--no-repro", "--out", str(out)],
    )  # fmt: skip
    assert res.exit_code == 1, res.output
    keep = json.loads((out / "report.json").read_text())["quantization"]["keep_in_float"]
    assert keep["nodes"] == ["up", "lm_head"] and keep["verified_by"] == "requantized"
    assert keep["goal"] == "1 − top-1 agreement of logits (worst of 8 inputs) ≤ 0.1"
    assert keep["verified"] is True and keep["requantized"]["after"] <= 0.1
    assert keep["figure"] == "top-1 agreement of logits"
    figures = keep["per_input"]
    assert sorted(Path(f["input"]).name for f in figures) == [f"x{i}.npz" for i in range(8)]
    assert all(f["before"] < 0.9 and f["after"] >= 0.9 and f["met"] for f in figures)
    assert (
        "Quantization: top-1 agreement of logits per input, before -> with the set (8 of 8 "
        "meet the goal):" in " ".join(res.output.split())
    )
    html = (out / "report.html").read_text()
    assert "<p>top-1 agreement of logits per input, before -&gt; with the set (8 of 8" in html


@pytest.mark.slow
def test_a_llama_whose_mlp_overflows_keeps_its_final_rmsnorm_in_float32(tmp_path: Path) -> None:
    """A two-layer Llama (external weights) whose second MLP's up projection is 400 times too
    large: its residual stream holds values whose squares float16 cannot hold, so the final
    RMSNorm's Pow overflows and every logit is lost. Computing that norm's Pow, ReduceMean,
    Add and Sqrt in float32 (module model.norm, as Hugging Face's LlamaRMSNorm does) brings
    every prompt's next token back; as a node_block_list, onnxconverter-common's conversion
    of the external-weight model holds on ONNX Runtime too."""
    from tests.llama_model import write_external_llama

    path = tmp_path / "llama.onnx"
    write_external_llama(path, layers=2, hidden=128, intermediate=256, vocab=512, heads=4,
                         seq=8, scaled={"model.layers.1.mlp.up_proj.weight": 400.0})  # fmt: skip
    data = tmp_path / "prompts"
    data.mkdir()
    rng = np.random.default_rng(1)
    for i in range(8):
        np.savez(data / f"p{i}.npz", input_ids=rng.integers(0, 512, (1, 8)).astype(np.int64))
    out = tmp_path / "out"
    res = CliRunner().invoke(
        bisect_app,
        [str(path), "-t", "torch:cpu?dtype=float16", "--dataset", str(data), "--quant-goal",
         "top1:logits@last>=100%", "--no-repro", "--out", str(out)],
    )  # fmt: skip
    assert res.exit_code == 1, res.output
    keep = json.loads((out / "report.json").read_text())["keep_in_fp32"]
    norm = ["/model/norm/Pow", "/model/norm/ReduceMean", "/model/norm/Add", "/model/norm/Sqrt"]
    assert keep["nodes"] == norm and keep["modules"] == ["model.norm"]
    assert keep["verified"] is True
    assert [(f["before"], f["after"], f["met"]) for f in keep["per_input"]] == [
        (0.0, 1.0, True)
    ] * 8
    assert keep["note"].endswith("it meets the goal on 8 of 8 inputs")
