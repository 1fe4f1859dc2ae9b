"""Dataset mode: many inputs screened, the worst sampled, the worst diagnosed; a fault that
fires on some inputs only is named with its fraction and confirmed over the sample.

The fault is ``--input-fault`` of the simulated runtime: ``/fc2/MatMul`` of ``models.mlp()``
is 5% off when its input (a ReLU's output) exceeds 5 in magnitude, which only the three
"bright" inputs (x scaled ×10) reach. What to expect is computed here with numpy from the
model's own weights, independently of the tool.
"""

from __future__ import annotations

import csv
import json
import math
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from typer.testing import CliRunner

import onnx_bisect
from onnx_bisect.cli import bisect_app
from onnx_bisect.compare.criterion import Comparison, Status
from onnx_bisect.compare.topk import TopKCheck
from onnx_bisect.dataset_result import InputScreen
from onnx_bisect.engine.dataset.stats import (
    MeasuredInput,
    NodeSample,
    confirm,
    node_stats,
    rank,
    spread,
    task_agreement,
)
from onnx_bisect.errors import InputError
from onnx_bisect.inputs.dataset import DatasetItem, check_dataset, find_dataset, load_item
from onnx_bisect.inputs.signature import input_specs
from onnx_bisect.report.serialize import DATASET_COLUMNS, NODE_COLUMNS
from onnx_bisect.result import CauseKind, RootCause
from tests.models import FAULTY_RUNTIME, mlp

runner = CliRunner()
FAULT, FACTOR, TRIGGER = "/fc2/MatMul", 0.05, 5.0
BRIGHT = (2, 5, 8)  # inputs scaled ×10: the only ones whose /fc2 input exceeds TRIGGER
N = 10
IN_PROCESS = f"tests.faulty:InputFaultBackend?node={FAULT}&factor={FACTOR}&trigger={TRIGGER}"


def faulty_exec() -> str:
    args = [sys.executable, str(FAULTY_RUNTIME), "{model}", "{inputs}", "{outputs}"]
    args += ["--input-fault", f"{FAULT}={FACTOR}:{TRIGGER}"]
    return "exec:" + shlex.join(args)


@dataclass(frozen=True)
class Data:
    model: Path
    folder: Path  # x_0..x_6.npz and test_data_set_7..9
    stack: Path  # the same ten inputs as one .npz of shape (10, 16): rows of x
    labels: tuple[str, ...]  # label of input i, as the folder lists it
    errors: tuple[float, ...]  # the output's rel_l2 of input i, by numpy


def _inputs() -> list[np.ndarray[Any, Any]]:
    rng = np.random.default_rng(3)
    return [
        (rng.uniform(-1, 1, (1, 16)) * (10.0 if i in BRIGHT else 1.0)).astype(np.float32)
        for i in range(N)
    ]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Data:
    root = tmp_path_factory.mktemp("dataset")
    model = mlp()
    onnx.save(model, root / "mlp.onnx")
    w = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    folder = root / "data"
    folder.mkdir()
    xs = _inputs()
    labels, errors = [], []
    for i, x in enumerate(xs):
        if i < 7:
            path = folder / f"x_{i}.npz"
            np.savez(path, x=x)
        else:
            path = folder / f"test_data_set_{i}"
            path.mkdir()
            (path / "input_0.pb").write_bytes(numpy_helper.from_array(x, "x").SerializeToString())
        labels.append(str(path))
        h2 = np.maximum(x.astype(np.float64) @ w["W1"], 0)
        assert (h2.max() > TRIGGER) == (i in BRIGHT)  # the premise of every test here
        h3 = h2 @ w["W2"]
        y = h3 + w["b"]
        fired = y + FACTOR * h3 if i in BRIGHT else y
        errors.append(float(np.linalg.norm(fired - y) / np.linalg.norm(y)))
    np.savez(root / "stack.npz", x=np.concatenate(xs))
    return Data(root / "mlp.onnx", folder, root / "stack.npz", tuple(labels), tuple(errors))


def expected_ranking(d: Data) -> list[str]:
    bright = sorted(BRIGHT, key=lambda i: -d.errors[i])
    return [d.labels[i] for i in bright]


# --- finding and loading inputs ---------------------------------------------------------------


def test_a_folder_lists_npz_files_and_test_cases_in_natural_order(tmp_path: Path) -> None:
    for name in ("x_10.npz", "x_2.npz", "notes.txt", "model.onnx"):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "test_data_set_1").mkdir()
    (tmp_path / "other_dir").mkdir()
    items = find_dataset(tmp_path)
    assert [i.path.name for i in items] == ["test_data_set_1", "x_2.npz", "x_10.npz"]
    assert [i.path.name for i in find_dataset(str(tmp_path / "x_*.npz"))] == [
        "x_2.npz",
        "x_10.npz",
    ]


def test_one_npz_is_split_along_its_leading_axis(data: Data) -> None:
    specs = input_specs(onnx.load(data.model))
    items = find_dataset(data.stack)
    assert len(items) == N and items[3] == DatasetItem(data.stack, 3)
    assert items[3].label == f"{data.stack}[3]"
    # (10, 16) rows against the model's [1, 16]: each row keeps a batch of one.
    np.testing.assert_array_equal(load_item(items[3], specs)["x"], _inputs()[3])
    # One rank above the model's gives x[i] as it is.
    stacked = data.stack.parent / "stacked.npz"
    np.savez(stacked, x=np.stack(_inputs()))  # (10, 1, 16)
    np.testing.assert_array_equal(load_item(find_dataset(stacked)[4], specs)["x"], _inputs()[4])


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p, "dataset {p}: no .npz or .npy files and no test_data_set_* folders in it"),
        (lambda p: p / "*.npz", "dataset {p}/*.npz matches nothing"),
        (lambda p: p / "missing", "dataset {p}/missing: no such file or directory"),
    ],
    ids=["empty-folder", "glob-matches-nothing", "missing"],
)
def test_a_dataset_of_nothing_is_refused(tmp_path: Path, make: Any, message: str) -> None:
    with pytest.raises(InputError) as exc:
        find_dataset(make(tmp_path))
    assert str(exc.value) == message.format(p=tmp_path) and exc.value.option == "dataset"


def test_inputs_that_differ_in_shape_are_refused(tmp_path: Path, data: Data) -> None:
    np.savez(tmp_path / "a.npz", x=np.zeros((1, 16), np.float32))
    np.savez(tmp_path / "b.npz", x=np.zeros((2, 16), np.float32))
    specs = input_specs(mlp())
    with pytest.raises(InputError, match="but dim 0 must be 1"):
        check_dataset(find_dataset(tmp_path), specs)
    dynamic = input_specs(mlp())[0]
    dynamic = type(dynamic)(dynamic.name, dynamic.dtype, (None, 16))
    with pytest.raises(InputError) as exc:
        check_dataset(find_dataset(tmp_path), [dynamic])
    assert str(exc.value) == (
        f"dataset {tmp_path}/b.npz gives 'x' as float32 2x16 but {tmp_path}/a.npz as float32 "
        "1x16; every input of a dataset has the same dtypes and shapes"
    )


def test_a_split_npz_needs_one_leading_axis(tmp_path: Path) -> None:
    np.savez(tmp_path / "s.npz", x=np.zeros((3, 16), np.float32), z=np.zeros((2, 4), np.float32))
    with pytest.raises(InputError, match=r"leading axes differ or are empty \(x: 3, z: 2\)"):
        find_dataset(tmp_path / "s.npz")
    with pytest.raises(InputError, match="one file must be a .npz"):
        np.save(tmp_path / "a.npy", np.zeros(3))
        find_dataset(tmp_path / "a.npy")


# --- the statistics, pure ----------------------------------------------------------------------


def _sample(name: str, acc: float, iso: float, *, diverged: bool, alone: bool) -> NodeSample:
    return NodeSample(0, name, "MatMul", acc, iso, diverged, alone)


def test_spread_is_mean_p95_and_max_without_nans() -> None:
    s = spread([0.0, 0.0, 0.0, 0.1, 0.2, math.nan])
    assert s is not None
    # p95 of five values, linear: position 0.95 × 4 = 3.8 between 0.1 and 0.2.
    assert (s.mean, s.max) == pytest.approx((0.06, 0.2)) and s.p95 == pytest.approx(0.18)
    assert spread([math.nan]) is None
    inf = spread([1.0, math.inf])
    assert inf is not None and inf.max == math.inf


def test_node_stats_and_confirmation_over_inputs() -> None:
    measured = [
        MeasuredInput(0, "a", True, (_sample("n", 0.05, 0.05, diverged=True, alone=True),)),
        MeasuredInput(1, "b", True, (_sample("n", 0.04, 0.0, diverged=True, alone=False),)),
        MeasuredInput(2, "c", False, (_sample("n", 0.0, 0.0, diverged=False, alone=False),)),
        MeasuredInput(3, "d", False, (_sample("n", 0.0, 0.02, diverged=False, alone=True),)),
    ]
    (n,) = node_stats(measured)
    assert (n.inputs, n.diverged, n.wrong_alone) == (4, 2, 2)
    assert n.diverged_fraction == 0.5 and n.accumulated is not None
    assert n.accumulated.mean == pytest.approx(0.0225) and n.accumulated.max == 0.05
    c = confirm(RootCause(CauseKind.CULPRIT, ("n",), "why"), measured)
    assert c is not None
    assert (c.confirmed, c.sampled, c.diverging, c.confirmed_diverging) == (2, 4, 2, 1)
    assert confirm(RootCause(CauseKind.PATTERN, ("n",), "why"), measured) is None


def _screen(i: int, error: float, *, diverged: bool, failed: str = "") -> InputScreen:
    out = Comparison("y", Status.DIVERGED if diverged else Status.OK, error)
    return InputScreen(i, f"in{i}", (out,), diverged, error, error, failed)


def test_rank_puts_failures_then_divergences_then_the_largest_errors_first() -> None:
    screens = [
        _screen(0, 0.01, diverged=False),
        _screen(1, 0.02, diverged=True),
        _screen(2, 0.5, diverged=True),
        InputScreen(3, "in3", (), True, None, math.inf, "target crashed"),
        _screen(4, 0.02, diverged=True),
        _screen(5, 0.03, diverged=False),
    ]
    assert [s.index for s in rank(screens)] == [3, 2, 1, 4, 5, 0]


def test_task_checks_are_aggregated_into_an_agreement_rate() -> None:
    def check(top1: float, changed: int) -> TopKCheck:
        return TopKCheck("y", "1:y@-1", 1, 4, top1, top1, changed)

    screens = [
        InputScreen(i, f"in{i}", (), False, 0.0, 0.0, task_checks=(c,))
        for i, c in enumerate([check(1.0, 0), check(0.75, 1), check(1.0, 0), check(0.5, 2)])
    ]
    (agg,) = task_agreement(screens)
    assert (agg.inputs, agg.agreeing, agg.rows_changed) == (4, 2, 3)
    assert agg.agreement_rate == 0.5 and agg.top1_agreement == pytest.approx(0.8125)


# --- the whole run ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def folder_result(data: Data) -> onnx_bisect.BisectResult:
    return onnx_bisect.bisect(data.model, target=IN_PROCESS, dataset=data.folder, topk=["1:y"])


def test_the_planted_node_is_named_with_its_fraction_and_confirmed(
    data: Data, folder_result: onnx_bisect.BisectResult
) -> None:
    r, d = folder_result, folder_result.dataset
    assert d is not None and r.diverged
    assert r.root_cause is not None and r.root_cause.nodes == (FAULT,)
    assert r.root_cause.kind is CauseKind.CULPRIT
    ranked = [s.label for s in d.screened]
    assert ranked[:3] == expected_ranking(data)
    assert d.worst == ranked[0] and (d.diverged, d.failed) == (3, 0)
    assert [s.error for s in d.screened[:3]] == pytest.approx(
        sorted((data.errors[i] for i in BRIGHT), reverse=True), rel=1e-4
    )
    assert d.sample == tuple(ranked[:8])  # the default sample, worst first
    c = d.confirmation
    assert c is not None and c.nodes == (FAULT,)
    assert (c.confirmed, c.sampled, c.diverging, c.confirmed_diverging) == (3, 8, 3, 3)
    assert d.lines()[:2] == [
        f"outputs diverge on 3 of 10 inputs; 8 sampled, worst first; the worst, {ranked[0]}, "
        "is shown below",
        f"culprit {FAULT} wrong alone on 3 of 8 sampled inputs (3 of the 3 that diverge)",
    ]
    # The worst input is the one diagnosed in full, and the one saved for a replay.
    worst = data.labels.index(d.worst)
    np.testing.assert_array_equal(r.inputs["x"], _inputs()[worst])


def test_per_node_statistics_match_the_planted_fault(
    data: Data, folder_result: onnx_bisect.BisectResult
) -> None:
    d = folder_result.dataset
    assert d is not None
    fault, add = d.node(FAULT), d.node("/out/Add")
    assert fault is not None and add is not None
    assert (fault.inputs, fault.diverged, fault.wrong_alone) == (8, 3, 3)
    assert (add.inputs, add.diverged, add.wrong_alone) == (8, 3, 0)
    assert fault.accumulated is not None and fault.isolated is not None
    # /fc2 is exactly 5% off where the fault fires and exact elsewhere.
    assert fault.accumulated.max == pytest.approx(FACTOR, rel=1e-4)
    assert fault.accumulated.mean == pytest.approx(3 * FACTOR / 8, rel=1e-4)
    assert fault.isolated.max == pytest.approx(FACTOR, rel=1e-4)
    # The output carries the three errors numpy predicts; five zeros below them.
    bright = sorted(data.errors[i] for i in BRIGHT)
    values = np.array([0.0] * 5 + bright)
    assert add.accumulated is not None and add.isolated is not None
    assert add.accumulated.max == pytest.approx(bright[-1], rel=1e-4)
    assert add.accumulated.p95 == pytest.approx(np.percentile(values, 95), rel=1e-4)
    assert add.isolated.max == 0.0
    for name in ("/fc1/MatMul", "/relu/Relu"):
        n = d.node(name)
        assert n is not None and (n.diverged, n.wrong_alone) == (0, 0)


def test_topk_is_aggregated_over_the_inputs(
    data: Data, folder_result: onnx_bisect.BisectResult
) -> None:
    d = folder_result.dataset
    assert d is not None
    (agg,) = d.task_checks
    model = mlp()
    w = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    flips = 0
    for i, x in enumerate(_inputs()):
        h3 = np.maximum(x.astype(np.float64) @ w["W1"], 0) @ w["W2"]
        y = h3 + w["b"]
        flips += int(i in BRIGHT and np.argmax(y) != np.argmax(y + FACTOR * h3))
    assert (agg.output, agg.inputs, agg.agreeing) == ("y", N, N - flips)


def test_reports_carry_the_dataset(
    tmp_path: Path, data: Data, folder_result: onnx_bisect.BisectResult
) -> None:
    onnx_bisect.write_reports(folder_result, tmp_path, ["json", "csv", "md"])
    report = json.loads((tmp_path / "report.json").read_text())
    ds = report["dataset"]
    assert (ds["inputs"], ds["diverged"], ds["worst"]) == (N, 3, expected_ranking(data)[0])
    assert [e["input"] for e in ds["ranking"][:3]] == expected_ranking(data)
    assert ds["confirmation"] == {
        "nodes": [FAULT],
        "confirmed": 3,
        "sampled": 8,
        "diverging": 3,
        "confirmed_diverging": 3,
    }
    with (tmp_path / "nodes.csv").open() as f:
        rows = {r["node"]: r for r in csv.DictReader(f)}
        assert tuple(next(csv.reader((tmp_path / "nodes.csv").open()))) == (
            NODE_COLUMNS + DATASET_COLUMNS
        )
    fault = rows[FAULT]
    assert (fault["sampled"], fault["diverged_fraction"], fault["culprit_fraction"]) == (
        "8",
        "0.375",
        "0.375",
    )
    assert float(fault["acc_max"]) == pytest.approx(FACTOR, rel=1e-4)
    assert rows["/out/Add"]["culprit_fraction"] == "0.0"
    md = (tmp_path / "report.md").read_text()
    assert f"culprit {FAULT} wrong alone on 3 of 8 sampled inputs" in md
    assert "**Inputs, worst first** (10 inputs in `report.json`)" in md


def test_a_matching_dataset_stops_after_the_screen(data: Data) -> None:
    r = onnx_bisect.bisect(data.model, target="cpu?opt=disable", dataset=data.folder)
    assert not r.diverged and r.dataset is not None
    assert r.dataset.diverged == 0 and r.dataset.nodes == () and r.dataset.confirmation is None
    assert r.runs["target"] == N + 1  # the screen of each input, then the worst's own
    assert dict(r.stage_runs) == {"screen inputs": N, "screen": 1}


# --- the command line -----------------------------------------------------------------------------


@pytest.mark.slow
def test_cli_names_the_input_dependent_fault_of_the_exec_runtime(
    tmp_path: Path, data: Data
) -> None:
    """The simulated runtime as a separate process per run, on the stack split in rows."""
    out = tmp_path / "report"
    args = [str(data.model), "--target", faulty_exec(), "--dataset", str(data.stack)]
    res = runner.invoke(bisect_app, [*args, "--sample", "4", "--out", str(out), "--top", "0"])
    assert res.exit_code == 1, res.output
    worst = f"{data.stack}[{sorted(BRIGHT, key=lambda i: -data.errors[i])[0]}]"
    assert (
        f"Dataset: outputs diverge on 3 of 10 inputs; 4 sampled, worst first; the worst, {worst}, "
        "is shown below" in res.stdout
    )
    assert (
        f"Dataset: culprit {FAULT} wrong alone on 3 of 4 sampled inputs (3 of the 3 that diverge)"
        in res.stdout
    )
    assert f"Root cause (culprit): {FAULT}" in res.stdout
    report = json.loads((out / "report.json").read_text())
    assert report["dataset"]["sample"] == [f"{data.stack}[{i}]" for i in _order(data)[:4]]
    assert report["repro"]["nodes"] == [FAULT] and report["repro"]["reproduces"] is True


def _order(data: Data) -> list[int]:
    """Input indices worst first as the tool ranks them: the bright ones by error, then the
    rest by index (their outputs are exact)."""
    bright = sorted(BRIGHT, key=lambda i: -data.errors[i])
    return bright + [i for i in range(N) if i not in BRIGHT]


def test_one_npz_given_to_input_stays_one_input(tmp_path: Path, data: Data) -> None:
    one = tmp_path / "one.npz"
    np.savez(one, x=_inputs()[BRIGHT[0]])
    res = runner.invoke(
        bisect_app,
        [str(data.model), "-t", IN_PROCESS, "--input", str(one), "-o", str(tmp_path / "r")],
    )
    assert res.exit_code == 1, res.output
    assert "Dataset" not in res.stdout
    assert "dataset" not in json.loads((tmp_path / "r" / "report.json").read_text())
    header = next(csv.reader((tmp_path / "r" / "nodes.csv").open()))
    assert tuple(header) == NODE_COLUMNS


def _cli_error(args: Sequence[str]) -> str:
    res = runner.invoke(bisect_app, list(args))
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1, res.output
    return lines[0]


def test_bad_datasets_are_one_line_and_exit_2(tmp_path: Path, data: Data) -> None:
    model = str(data.model)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _cli_error([model, "-t", "cpu", "--dataset", str(empty)]) == (
        f"error: --dataset {empty}: no .npz or .npy files and no test_data_set_* folders in it"
    )
    assert _cli_error([model, "-t", "cpu", "--dataset", f"{empty}/*.npz"]) == (
        f"error: --dataset {empty}/*.npz matches nothing"
    )
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    np.savez(mixed / "a.npz", x=np.zeros((1, 16), np.float32))
    np.savez(mixed / "b.npz", x=np.zeros((1, 16), np.float64))
    assert _cli_error([model, "-t", "cpu", "--dataset", str(mixed)]) == (
        f"error: --dataset {mixed}/b.npz: input 'x' has dtype float64 but the model expects "
        "float32; cast it (e.g. arr.astype(np.float32))"
    )


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--sample", "3"], "error: --sample 3 applies only with a dataset"),
        (["--jobs", "2"], "error: --jobs 2 applies only with a dataset"),
        (["--ray", "local"], "error: --ray 'local' applies only with a dataset"),
        (
            ["--dataset", "d", "--input", "x.npz"],
            "error: --dataset: the inputs are given as well; give a dataset for many inputs or "
            "the inputs of one, not both",
        ),
        (["--dataset", "d", "--sample", "0"], "error: --sample must be an integer >= 1, got 0"),
        (["--dataset", "d", "--jobs", "0"], "error: --jobs must be an integer >= 1, got 0"),
        (
            ["--dataset", "d", "--shape", "x=1x16"],
            "error: --dataset: shapes apply to generated inputs only, and a dataset's inputs "
            "are given; leave them out",
        ),
    ],
    ids=["sample", "jobs", "ray", "input", "sample-0", "jobs-0", "shape"],
)
def test_dataset_options_are_checked_before_any_work(
    data: Data, extra: list[str], message: str
) -> None:
    assert _cli_error([str(data.model), "-t", "cpu", *extra]) == message


def test_a_dump_cannot_take_a_dataset(tmp_path: Path, data: Data) -> None:
    with pytest.raises(InputError) as exc:
        onnx_bisect.bisect(data.model, target=f"dump:{tmp_path}", dataset=data.folder)
    assert str(exc.value) == (
        f"dataset: the target dump:{tmp_path} replays tensors recorded for one input; a "
        "dataset needs backends that compute"
    )


def test_backend_objects_cannot_go_to_workers(data: Data) -> None:
    from tests.faulty import FaultyBackend

    for parallel in ({"jobs": 2}, {"ray": "local"}):
        with pytest.raises(InputError) as exc:
            onnx_bisect.bisect(
                data.model, target=FaultyBackend(FAULT), dataset=data.folder, **parallel
            )
        (option,) = parallel
        assert exc.value.option == option
        assert str(exc.value) == (
            f"{option}: workers build their own backends, so ref and target must be specs "
            "(strings), not Backend objects; run those with jobs=1"
        )


# --- workers --------------------------------------------------------------------------------------


def assert_same(r: onnx_bisect.BisectResult, other: onnx_bisect.BisectResult) -> None:
    """The same culprit, ranking, sample, confirmation and per-node counts; the same errors up
    to float64 rounding: workers run with OPENBLAS/OMP/MKL_NUM_THREADS set to their share of
    the cores, and BLAS sums in an order that follows its thread count (2e-15 relative on
    YOLO-sized tensors; bit-identical when jobs=1 runs with the same variables)."""
    d, e = r.dataset, other.dataset
    assert d is not None and e is not None and r.root_cause is not None
    assert other.root_cause is not None and r.root_cause.nodes == other.root_cause.nodes
    assert [s.label for s in d.screened] == [s.label for s in e.screened]
    assert (d.sample, d.confirmation) == (e.sample, e.confirmation)
    assert [s.error for s in d.screened] == pytest.approx([s.error for s in e.screened], rel=1e-9)
    for n, m in zip(d.nodes, e.nodes, strict=True):
        assert (n.name, n.inputs, n.diverged, n.wrong_alone) == (
            m.name,
            m.inputs,
            m.diverged,
            m.wrong_alone,
        )
        for a, b in ((n.accumulated, m.accumulated), (n.isolated, m.isolated)):
            assert (a is None) == (b is None)
            if a is not None and b is not None:
                assert (a.mean, a.p95, a.max) == pytest.approx((b.mean, b.p95, b.max), rel=1e-9)


@pytest.mark.slow
def test_two_jobs_give_the_same_result_as_one(
    data: Data, folder_result: onnx_bisect.BisectResult
) -> None:
    two = onnx_bisect.bisect(
        data.model, target=IN_PROCESS, dataset=data.folder, topk=["1:y"], jobs=2
    )
    assert_same(two, folder_result)
    assert two.dataset is not None and two.dataset.jobs == 2


@pytest.mark.slow
def test_a_local_ray_cluster_gives_the_same_result_as_one_job(data: Data) -> None:
    pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'onnx-bisect[ray]'")
    target = faulty_exec()
    one = onnx_bisect.bisect(data.model, target=target, dataset=data.folder, sample=4)
    on_ray = onnx_bisect.bisect(
        data.model, target=target, dataset=data.folder, sample=4, ray="local"
    )
    assert_same(on_ray, one)
