"""Faults inside Loop bodies are named at the body node of the iteration that first goes wrong,
not at the Loop; the report says how many iterations ran. Real ONNX Runtime sessions; faults
planted inside the bodies."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

import onnx_bisect
from onnx_bisect.graph.unroll import unroll_loops
from onnx_bisect.result import CauseKind
from tests.faulty import FaultyBackend

ROOT = Path(__file__).resolve().parents[1]
X = {"x": np.array([1.0, -2.0, 3.0, 0.5], np.float32)}


def loop_model(
    trip: int = 3, stop: int | None = None, scan: bool = True, opset: int = 17
) -> onnx.ModelProto:
    """x -> Relu -> Loop(v = v * 0.9 + iter; scan tanh(v)) -> Sigmoid. With ``stop`` the body
    computes its condition (iter < stop, a while-loop); else it passes it through (a for-loop)."""
    body_nodes = [
        helper.make_node("Cast", ["iter"], ["iter_f"], to=T.FLOAT, name="cast_iter"),
        helper.make_node("Mul", ["v_in", "w"], ["scaled"], name="body_mul"),
        helper.make_node("Add", ["scaled", "iter_f"], ["v_out"], name="body_add"),
        helper.make_node("Tanh", ["v_out"], ["s_out"], name="body_tanh"),
    ]
    inits = [numpy_helper.from_array(np.array(0.9, np.float32), "w")]
    if stop is None:
        body_nodes.append(helper.make_node("Identity", ["cond_in"], ["cond_out"], name="pass"))
    else:
        body_nodes.append(helper.make_node("Less", ["iter", "stop"], ["cond_out"], name="less"))
        inits.append(numpy_helper.from_array(np.array(stop, np.int64), "stop"))
    outs = [
        helper.make_tensor_value_info("cond_out", T.BOOL, []),
        helper.make_tensor_value_info("v_out", T.FLOAT, [4]),
    ] + ([helper.make_tensor_value_info("s_out", T.FLOAT, [4])] if scan else [])
    body = helper.make_graph(
        body_nodes, "body",
        [
            helper.make_tensor_value_info("iter", T.INT64, []),
            helper.make_tensor_value_info("cond_in", T.BOOL, []),
            helper.make_tensor_value_info("v_in", T.FLOAT, [4]),
        ],
        outs, initializer=inits,
    )  # fmt: skip
    loop_out = ["v_final"] + (["scanned"] if scan else [])
    graph = helper.make_graph(
        [
            helper.make_node("Relu", ["x"], ["r"], name="pre"),
            helper.make_node("Loop", ["M", "cond", "r"], loop_out, body=body, name="loop"),
            helper.make_node("Sigmoid", ["v_final"], ["y"], name="post"),
        ],
        "loop_model",
        [helper.make_tensor_value_info("x", T.FLOAT, [4])],
        [helper.make_tensor_value_info("y", T.FLOAT, [4])]
        + ([helper.make_tensor_value_info("scanned", T.FLOAT, ["n", 4])] if scan else []),
        initializer=[
            numpy_helper.from_array(np.array(trip, np.int64), "M"),
            numpy_helper.from_array(np.array(True), "cond"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def _run(model: onnx.ModelProto) -> list[np.ndarray]:
    return ort.InferenceSession(model.SerializeToString()).run(None, X)  # type: ignore[return-value]


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"stop": 2, "trip": 1000}, {"opset": 11}, {"scan": False}],
    ids=["for", "while", "opset11", "no-scan"],
)
def test_unrolling_keeps_every_output_and_leaves_the_callers_model_alone(kwargs: dict) -> None:
    model = loop_model(**kwargs)
    flat, unrolled = unroll_loops(model, {"loop": 3})
    onnx.checker.check_model(flat, full_check=True)
    assert [(u.node, u.iterations) for u in unrolled] == [("loop", 3)]
    assert unrolled[0].conditions[-1] == "loop/iteration_2/cond_out"
    names = [n.name for n in flat.graph.node]
    assert "loop/iteration_0/body_mul" in names and "loop/iteration_2/body_tanh" in names
    assert not any(n.op_type == "Loop" for n in flat.graph.node)
    assert any(n.op_type == "Loop" for n in model.graph.node)  # untouched
    for before, after in zip(_run(model), _run(flat), strict=True):
        np.testing.assert_allclose(before, after, rtol=1e-6)


def test_a_wrong_iteration_count_gives_other_values() -> None:
    # The check above can fail: unrolled one iteration short, the values differ.
    model = loop_model(scan=False)
    flat, _ = unroll_loops(model, {"loop": 2})
    assert not np.allclose(_run(model)[0], _run(flat)[0])


@pytest.mark.parametrize(
    ("kwargs", "iterations"), [({}, 3), ({"stop": 4, "trip": 10**12}, 5)], ids=["for", "while"]
)
def test_a_fault_in_the_body_is_named_at_the_body_node(kwargs: dict, iterations: int) -> None:
    result = onnx_bisect.bisect(
        loop_model(**kwargs), target=FaultyBackend("body_add", 0.05), inputs=X
    )
    assert result.verdict == "diverged"
    cause = result.root_cause
    assert cause is not None and cause.kind is CauseKind.CULPRIT
    assert cause.nodes == ("loop/iteration_0/body_add",)
    assert any(f"Loop 'loop' ran {iterations} iterations" in n for n in result.notes)


def test_a_loop_beyond_unroll_max_stays_whole_and_says_so() -> None:
    result = onnx_bisect.bisect(
        loop_model(trip=5), target=FaultyBackend("body_add", 0.05), inputs=X, unroll_max=4
    )
    assert result.verdict == "diverged"
    assert result.root_cause is not None and result.root_cause.nodes == ("loop",)
    assert any("runs more than 4 iterations (--unroll-max)" in n for n in result.notes)


def test_a_while_loop_beyond_unroll_max_stays_whole() -> None:
    result = onnx_bisect.bisect(
        loop_model(stop=10, trip=10**12), target=FaultyBackend("body_add", 0.05), inputs=X,
        unroll_max=6,
    )  # fmt: skip
    assert result.root_cause is not None and result.root_cause.nodes == ("loop",)
    assert any("runs more than 6 iterations" in n for n in result.notes)


def test_a_loop_that_runs_no_iteration_with_no_scan_output_is_passed_through() -> None:
    model = loop_model(trip=0, scan=False)
    result = onnx_bisect.bisect(model, target=FaultyBackend("post", 0.05), inputs=X)
    assert result.root_cause is not None and result.root_cause.nodes == ("post",)
    assert any("Loop 'loop' ran 0 iterations" in n for n in result.notes)


@pytest.mark.slow
def test_cli_names_the_body_node_and_writes_a_bundle_that_reproduces(tmp_path: Path) -> None:
    path = tmp_path / "loop.onnx"
    onnx.save(loop_model(), path)
    runtime = f"{sys.executable} {ROOT / 'examples' / 'faulty_runtime.py'}"
    target = f"exec:{runtime} {{model}} {{inputs}} {{outputs}} --fault body_tanh=0.2"
    out = tmp_path / "report"
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "bisect"), str(path), "-t", target, "--out", str(out)],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Root cause (culprit): loop/iteration_0/body_tanh" in proc.stdout, proc.stdout
    assert "Loop 'loop' ran 3 iterations" in proc.stdout
    assert "reproduces" in (out / "repro" / "README.md").read_text()


def loop_with_if() -> onnx.ModelProto:
    """A Loop whose body holds an If on ``iter > 0`` reading the body's own tensor: the If of
    iteration 0 takes its else branch, the later ones their then branch."""
    then_g = helper.make_graph(
        [helper.make_node("Neg", ["scaled"], ["t"], name="neg")],
        "then", [], [helper.make_tensor_value_info("t", T.FLOAT, [4])],
    )  # fmt: skip
    else_g = helper.make_graph(
        [helper.make_node("Abs", ["scaled"], ["e"], name="abs")],
        "else", [], [helper.make_tensor_value_info("e", T.FLOAT, [4])],
    )  # fmt: skip
    body = helper.make_graph(
        [
            helper.make_node("Mul", ["v_in", "w"], ["scaled"], name="body_mul"),
            helper.make_node("Greater", ["iter", "zero"], ["later"], name="gt"),
            helper.make_node(
                "If", ["later"], ["v_out"], name="choose", then_branch=then_g, else_branch=else_g
            ),
            helper.make_node("Identity", ["cond_in"], ["cond_out"], name="pass"),
        ],
        "body",
        [
            helper.make_tensor_value_info("iter", T.INT64, []),
            helper.make_tensor_value_info("cond_in", T.BOOL, []),
            helper.make_tensor_value_info("v_in", T.FLOAT, [4]),
        ],
        [
            helper.make_tensor_value_info("cond_out", T.BOOL, []),
            helper.make_tensor_value_info("v_out", T.FLOAT, [4]),
        ],
        initializer=[
            numpy_helper.from_array(np.array(0.9, np.float32), "w"),
            numpy_helper.from_array(np.array(0, np.int64), "zero"),
        ],
    )
    graph = helper.make_graph(
        [helper.make_node("Loop", ["M", "", "x"], ["y"], body=body, name="loop")],
        "loop_with_if",
        [helper.make_tensor_value_info("x", T.FLOAT, [4])],
        [helper.make_tensor_value_info("y", T.FLOAT, [4])],
        initializer=[numpy_helper.from_array(np.array(3, np.int64), "M")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def test_an_if_inside_a_loop_body_is_decided_per_iteration() -> None:
    result = onnx_bisect.bisect(loop_with_if(), target=FaultyBackend("neg", 0.05), inputs=X)
    assert result.verdict == "diverged"
    # Iteration 0 takes the else branch; the fault first shows where iteration 1 negates.
    assert result.root_cause is not None and result.root_cause.nodes == ("neg",)
    notes = " ".join(result.notes)
    assert "Loop 'loop' ran 3 iterations (3 Ifs nested in them were decided too)" in notes


def test_unrolling_renames_what_a_nested_if_reads_from_the_body() -> None:
    model = loop_with_if()
    flat, _ = unroll_loops(model, {"loop": 3})
    onnx.checker.check_model(flat, full_check=True)
    ifs = [n for n in flat.graph.node if n.op_type == "If"]
    assert [n.name for n in ifs] == [f"loop/iteration_{i}/choose" for i in range(3)]
    reads = {n.input[0] for i in ifs for a in i.attribute for n in a.g.node}
    assert reads == {f"loop/iteration_{i}/scaled" for i in range(3)}
    np.testing.assert_allclose(_run(model)[0], _run(flat)[0], rtol=1e-6)


def scan_model(reverse_in: bool = False, axis_out: int = 0, axis_in: int = 0) -> onnx.ModelProto:
    """s = 0.9 s + x_t over the rows (axis_in 0) or columns (1) of xs; ys stacks tanh(s)."""
    body = helper.make_graph(
        [
            helper.make_node("Mul", ["s_in", "w"], ["decayed"], name="decay"),
            helper.make_node("Add", ["decayed", "x_t"], ["s_out"], name="accumulate"),
            helper.make_node("Tanh", ["s_out"], ["y_t"], name="squash"),
        ],
        "scan_body",
        [
            helper.make_tensor_value_info("s_in", T.FLOAT, [4]),
            helper.make_tensor_value_info("x_t", T.FLOAT, [4]),
        ],
        [
            helper.make_tensor_value_info("s_out", T.FLOAT, [4]),
            helper.make_tensor_value_info("y_t", T.FLOAT, [4]),
        ],
        initializer=[numpy_helper.from_array(np.array(0.9, np.float32), "w")],
    )
    xs_shape = [3, 4] if axis_in == 0 else [4, 3]
    graph = helper.make_graph(
        [
            helper.make_node("Relu", ["xs"], ["r"], name="pre"),
            helper.make_node(
                "Scan",
                ["s0", "r"],
                ["s_final", "ys"],
                body=body,
                name="scan",
                num_scan_inputs=1,
                scan_input_directions=[int(reverse_in)],
                scan_input_axes=[axis_in],
                scan_output_axes=[axis_out],
            ),  # fmt: skip
            helper.make_node("Sigmoid", ["s_final"], ["y"], name="post"),
        ],
        "scan_model",
        [helper.make_tensor_value_info("xs", T.FLOAT, xs_shape)],
        [
            helper.make_tensor_value_info("y", T.FLOAT, [4]),
            helper.make_tensor_value_info("ys", T.FLOAT, None),
        ],
        initializer=[numpy_helper.from_array(np.full(4, 0.5, np.float32), "s0")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


XS = {"xs": np.arange(12, dtype=np.float32).reshape(3, 4) / 7 - 0.5}


@pytest.mark.parametrize(
    ("kwargs", "feeds"),
    [
        ({}, XS),
        ({"reverse_in": True}, XS),
        ({"axis_out": 1}, XS),
        ({"axis_out": -1}, XS),
        ({"axis_in": 1, "reverse_in": True}, {"xs": XS["xs"].T.copy()}),
    ],
    ids=["forward", "reverse", "axis-out-1", "axis-out-neg", "axis-in-1"],
)
def test_scan_unrolling_keeps_every_output(kwargs: dict, feeds: dict) -> None:
    from onnx_bisect.graph.unroll import scan_plan, unroll_scans

    model = scan_model(**kwargs)
    node = next(n for n in model.graph.node if n.op_type == "Scan")
    plan = scan_plan(node, [2], [2], 3)
    flat, unrolled = unroll_scans(model, {"scan": plan})
    assert [(u.node, u.iterations) for u in unrolled] == [("scan", 3)]
    assert not any(n.op_type == "Scan" for n in flat.graph.node)

    def outputs(m: onnx.ModelProto) -> list[np.ndarray]:
        return ort.InferenceSession(m.SerializeToString()).run(None, feeds)  # type: ignore[return-value]

    for before, after in zip(outputs(model), outputs(flat), strict=True):
        assert before.shape == after.shape
        np.testing.assert_allclose(before, after, rtol=1e-6)


def test_a_fault_in_a_scan_body_is_named_at_the_body_node() -> None:
    result = onnx_bisect.bisect(scan_model(), target=FaultyBackend("squash", 0.05), inputs=XS)
    assert result.verdict == "diverged"
    assert result.root_cause is not None and result.root_cause.kind is CauseKind.CULPRIT
    assert result.root_cause.nodes == ("scan/iteration_0/squash",)
    assert any("Scan 'scan' ran 3 iterations" in n for n in result.notes)


def test_a_scan_beyond_unroll_max_stays_whole() -> None:
    result = onnx_bisect.bisect(
        scan_model(), target=FaultyBackend("squash", 0.05), inputs=XS, unroll_max=2
    )
    assert result.root_cause is not None and result.root_cause.nodes == ("scan",)
    assert any("Scan 'scan' runs 3 iterations, more than 2" in n for n in result.notes)
