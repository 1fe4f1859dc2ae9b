"""Multi-step models (``--steps``): the first step that diverges, then the node at that step.

A fault that starts at a step is written into the graph (tests/steps_models.py), conditioned
on the faulty node's own tensors, so it follows the node into every model the search cuts.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from typer.testing import CliRunner

import onnx_bisect
from onnx_bisect.cli import bisect_app
from onnx_bisect.errors import InputError
from onnx_bisect.inputs.signature import input_specs
from onnx_bisect.inputs.steps import detect_wiring, first_feeds, next_feeds
from tests.steps_models import ATTENTION, kv_decoder, streaming

runner = CliRunner()
FAULT = "tests/steps_models.py:StepFault"


@pytest.fixture(scope="module")
def kv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("kv") / "kv.onnx"
    onnx.save(kv_decoder(), path)
    return path


@pytest.fixture(scope="module")
def stream(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("stream")
    onnx.save(streaming(), d / "stream.onnx")
    x = np.random.default_rng(1).random((6, 1, 4)).astype(np.float32)
    x[3:] += 10  # from chunk 3 on, /in/Mul's input passes the fault's trigger
    np.savez(d / "chunks.npz", x=x)
    return d / "stream.onnx", d / "chunks.npz"


def test_hugging_face_names_are_wired() -> None:
    model = kv_decoder()
    outputs = [o.name for o in model.graph.output]
    w = detect_wiring(input_specs(model), outputs)
    assert w.state == (
        ("present.0.key", "past_key_values.0.key"),
        ("present.0.value", "past_key_values.0.value"),
    )
    assert (w.token, w.mask, w.positions) == (("logits", "input_ids"), "attention_mask", None)


def test_step_zero_starts_with_an_empty_cache_and_the_mask_grows() -> None:
    model = kv_decoder()
    specs = input_specs(model)
    w = detect_wiring(specs, [o.name for o in model.graph.output])
    ids = {"input_ids": np.array([[5]], np.int64)}
    feeds = first_feeds(w, specs, {**ids, "attention_mask": np.zeros((1, 1), np.int64)}, {}, None)
    assert feeds["past_key_values.0.key"].shape == (1, 1, 0, 8)
    assert feeds["attention_mask"].tolist() == [[1]]
    logits = np.zeros((1, 1, 16), np.float32)
    logits[0, 0, 11] = 1
    cache = np.ones((1, 1, 1, 8), np.float32)
    out = {"logits": logits, "present.0.key": cache, "present.0.value": cache}
    nxt = next_feeds(w, specs, feeds, out)
    assert nxt["input_ids"].tolist() == [[11]]
    assert nxt["attention_mask"].tolist() == [[1, 1]]
    assert nxt["past_key_values.0.key"].shape == (1, 1, 1, 8)


@pytest.mark.parametrize(
    ("rules", "message"),
    [
        (["zz=c0"], "state 'zz=c0': no output matches 'zz'"),
        (["n*=z*"], "state 'n*=z*': output 'n0' would feed 'z0', which is not an input"),
        (["n*=c0"], "state 'n*=c0': both sides need the same number of '*'"),
        (["n0"], "state 'n0': expected OUT=IN"),
    ],
)
def test_a_state_rule_that_wires_nothing_is_refused(rules: list[str], message: str) -> None:
    model = streaming()
    with pytest.raises(InputError, match="^" + message.replace("*", r"\*")):
        detect_wiring(input_specs(model), [o.name for o in model.graph.output], rules)


def test_a_model_with_nothing_to_carry_needs_a_rule() -> None:
    model = streaming()
    with pytest.raises(InputError, match="steps: nothing feeds one step from the one before"):
        detect_wiring(input_specs(model), [o.name for o in model.graph.output])


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"state": ["a=b"]}, "state ('a=b',) applies only with steps"),
        ({"free_run": True}, "free_run True applies only with steps"),
        ({"steps": 0}, "steps must be an integer >= 1, got 0"),
        ({"steps": 2, "dataset": "d"}, "steps: a dataset is a loop of its own"),
    ],
)
def test_step_options_are_checked(options: dict[str, object], message: str) -> None:
    opts = {k: tuple(v) if isinstance(v, list) else v for k, v in options.items()}
    with pytest.raises(InputError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        onnx_bisect.BisectOptions(**opts)  # type: ignore[arg-type]


def test_the_step_where_attention_reaches_five_is_found_and_its_matmul_named(kv: Path) -> None:
    r = onnx_bisect.bisect(kv, ref="cpu", target=f"{FAULT}?length=5", steps=8)
    assert r.diverged
    assert r.steps is not None and r.steps.count == 8
    # A 1-token prompt: step k attends over k + 1 positions, so 5 at step 4.
    assert r.steps.first_divergent_step == 4
    assert [s.diverged for s in r.steps.per_step] == [False] * 4 + [True] * 4
    assert r.root_cause is not None and r.root_cause.nodes == (ATTENTION,)
    assert r.inputs["past_key_values.0.key"].shape == (1, 1, 4, 8)  # step 4's own inputs


def test_without_the_fault_eight_steps_agree(kv: Path) -> None:
    r = onnx_bisect.bisect(kv, ref="cpu", target=f"{FAULT}?length=100", steps=8)
    assert not r.diverged
    assert r.steps is not None and r.steps.first_divergent_step is None
    assert r.steps.count == 8
    assert r.summary().splitlines()[1] == "Steps: 8 steps run teacher-forced; none diverges"


def test_the_cli_writes_the_steps_into_every_report(kv: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    res = runner.invoke(
        bisect_app,
        [str(kv), "--target", f"{FAULT}?length=5", "--steps", "6", "--out", str(out)],
    )
    assert res.exit_code == 1, res.output
    assert (
        "Steps: 6 steps run teacher-forced; step 4 is the first to diverge (the diagnosis "
        "below is of step 4, on its own inputs)"
    ) in " ".join(res.output.split())
    report = json.loads((out / "report.json").read_text())
    steps = report["steps"]
    assert (steps["count"], steps["first_divergent_step"], steps["mode"]) == (
        6,
        4,
        "teacher-forced",
    )
    assert [s["status"] for s in steps["per_step"]] == ["ok"] * 4 + ["diverged"] * 2
    md = (out / "report.md").read_text()
    assert "**Steps** (teacher-forced: both sides fed the reference's state and token)" in md
    assert "| 4 | diverged | logits |" in md
    html = (out / "report.html").read_text()
    assert '<h2 id="steps">Steps</h2>' in html
    with np.load(out / "inputs.npz") as saved:
        assert saved["attention_mask"].shape == (1, 5)


def test_a_streaming_fault_from_chunk_three_is_found_at_chunk_three(
    stream: tuple[Path, Path],
) -> None:
    model, chunks = stream
    r = onnx_bisect.bisect(
        model,
        ref="cpu",
        target=f"{FAULT}?node=/in/Mul&above=5",
        steps=6,
        state=("n*=c*",),
        chunks=chunks,
    )
    assert r.steps is not None and r.steps.first_divergent_step == 3
    carried = tuple(f"n{i} -> c{i}" for i in range(4))
    assert r.steps.wiring == (*carried, "x: chunk k at step k")
    assert r.root_cause is not None and r.root_cause.nodes == ("/in/Mul",)
    assert float(r.inputs["x"].max()) > 10  # chunk 3's values


def test_too_few_chunks_is_one_line(stream: tuple[Path, Path]) -> None:
    model, chunks = stream
    with pytest.raises(InputError, match=r"^chunks: 9 steps need 9 chunks along axis 0 of each "
                       r"array; x has 6$"):  # fmt: skip
        onnx_bisect.bisect(model, target="cpu", steps=9, state=("n*=c*",), chunks=chunks)


def test_a_near_tie_flipped_by_float16_is_no_divergence(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    path = tmp_path / "tie.onnx"
    onnx.save(kv_decoder(tie=True), path)
    r = onnx_bisect.bisect(
        path, ref="cpu", target="torch:cpu?dtype=float16", steps=4, free_run=True
    )
    assert not r.diverged
    steps = r.steps
    assert steps is not None and steps.first_divergent_step is None
    # float32 picks token 7 (logit 100.01), float16 cannot tell it from token 3's 100.
    assert [(s.ref_token, s.target_token, s.tie) for s in steps.per_step] == [(7, 3, True)] * 4
    assert steps.free_run is not None and steps.parted_at == 0
    assert steps.lines()[1].startswith("greedy token ties at step 0, 1, 2, 3:")


@pytest.mark.slow
def test_a_gpt2_export_with_its_kv_cache_is_stepped_and_its_attention_named(
    tmp_path: Path,
) -> None:
    pytest.importorskip("transformers")
    from tests.steps_models import export_gpt2

    path = tmp_path / "gpt2.onnx"
    attention = export_gpt2(path, layers=2)
    # 1-token prompt: step k attends over k + 1 positions, 9 at step 8.
    r = onnx_bisect.bisect(path, target=f"{FAULT}?node={attention}&length=9", steps=12)
    assert r.steps is not None and r.steps.first_divergent_step == 8
    assert r.root_cause is not None and r.root_cause.nodes == (attention,)
    assert r.steps.wiring[0] == "present.0.key -> past_key_values.0.key"
