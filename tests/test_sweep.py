"""``onnx-bisect sweep`` (issue 36): six models x two targets, one an in-process adapter that
aborts on one model's node, one an ``exec:`` runtime with a planted fault; the tables, the
baseline gate, resume, the real console script and Ray."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import onnx_bisect
from onnx_bisect.cases.plan import Case, ModelEntry, TargetEntry, parse_targets, slug
from onnx_bisect.cases.verdict import from_error, from_report, from_signal
from onnx_bisect.errors import InputError
from onnx_bisect.sweep_result import (
    CaseOutcome,
    CaseResult,
    Change,
    Stage,
    SweepResult,
    compare_baseline,
    is_worse,
)
from tests.models import FAULTY_RUNTIME, ROOT, chain, mlp, residual, two_inputs, with_if

BIN = Path(sys.executable).parent
CONV_BN = ROOT / "examples" / "models" / "conv_bn.onnx"
CRASH_NODE = "add1"  # residual's only: the in-process target aborts on that model alone
FAULT_NODE = "/relu/Relu"  # mlp's only: the exec: runtime computes it 5% wrong
NEW_FAULT = "stage1/sigmoid"  # conv_bn's: planted later, a new regression
MODELS = ("chain", "conv_bn", "mlp", "residual", "two_inputs", "with_if")


def faulty(*faults: str) -> str:
    flags = " ".join(f"--fault {node}=0.05" for node in faults)
    return f"faulty=exec:{sys.executable} {FAULTY_RUNTIME} {{model}} {{inputs}} {{outputs}} {flags}"


CRASHING = f"aborts=tests.faulty:AbortingBackend?node={CRASH_NODE}"
TARGETS = (faulty(FAULT_NODE), CRASHING)


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Six models in the ONNX zoo's layout or flat: chain's inputs from --inputs DIR, mlp's
    from a test_data_set_0 folder beside it, the others generated."""
    root = tmp_path_factory.mktemp("zoo")
    models = root / "models"
    (models / "mlp").mkdir(parents=True)
    for name, model in (("chain", chain()), ("residual", residual()), ("two_inputs", two_inputs())):
        onnx.save(model, models / f"{name}.onnx")
    onnx.save(with_if(), models / "with_if.onnx")
    onnx.save(mlp(), models / "mlp" / "mlp.onnx")
    (models / "conv_bn.onnx").write_bytes(CONV_BN.read_bytes())
    case = models / "mlp" / "test_data_set_0"
    case.mkdir()
    x = np.random.default_rng(1).standard_normal((1, 16)).astype(np.float32)
    (case / "input_0.pb").write_bytes(numpy_helper.from_array(x, "x").SerializeToString())
    inputs = root / "inputs"
    inputs.mkdir()
    np.savez(inputs / "chain.npz", x=np.full((1, 8), 0.5, np.float32))
    rng = np.random.default_rng(2)
    a, mask = rng.standard_normal((3, 4)).astype(np.float32), rng.random((3, 4)) > 0.5
    np.savez(inputs / "two_inputs.npz", a=a, mask=mask)
    return root


@pytest.fixture(scope="module")
def first(zoo: Path) -> SweepResult:
    """The sweep everything below reads: two cases at a time, a baseline written."""
    seen: list[CaseResult] = []
    result = onnx_bisect.sweep(
        [zoo / "models"],
        TARGETS,
        out=zoo / "out",
        inputs=zoo / "inputs",
        jobs=2,
        write_baseline=zoo / "baseline.json",
        on_case=seen.append,
    )
    assert len(seen) == 12
    return result


def _rows(out: Path) -> list[dict[str, str]]:
    with (out / "results.csv").open() as f:
        return list(csv.DictReader(f))


def test_every_case_gets_a_row_with_its_status_and_stage(first: SweepResult, zoo: Path) -> None:
    rows = _rows(zoo / "out")
    assert len(rows) == 12
    assert [(r["model"], r["target"]) for r in rows] == [
        (m, t) for m in MODELS for t in ("faulty", "aborts")
    ]
    by_case = {(r["model"], r["target"]): r for r in rows}
    crash = by_case[("residual", "aborts")]
    assert (crash["status"], crash["stage"], crash["root_kind"]) == ("crash", "run", "crash")
    assert crash["root_nodes"] == CRASH_NODE and crash["root_ops"] == "Add"
    # The target's crash ends its worker, not the case's bisect: no second run is needed, and
    # the command reproduces it as it is.
    assert "--isolate-crashes" not in crash["command"]
    wrong = by_case[("mlp", "faulty")]
    assert (wrong["status"], wrong["stage"], wrong["root_kind"]) == (
        "diverged",
        "numerics",
        "culprit",
    )
    assert wrong["root_nodes"] == FAULT_NODE == wrong["first_divergence"]
    assert wrong["bundle"] == "mlp/faulty/repro" and wrong["report"] == "mlp/faulty/report.md"
    assert (zoo / "out" / wrong["bundle"] / "model.onnx").is_file()
    others = [r for k, r in by_case.items() if k not in (("residual", "aborts"), ("mlp", "faulty"))]
    assert {r["status"] for r in others} == {"agree"}
    assert all(float(r["seconds"]) > 0 for r in rows)
    assert all(float(r["peak_memory_mb"]) > 10 for r in rows)  # psutil is in the venv
    # Each case's full report, as bisect writes it, where the row says.
    report = json.loads((zoo / "out" / "mlp" / "faulty" / "report.json").read_text())
    assert report["root_cause"]["nodes"] == [FAULT_NODE]
    # The inputs each model was given: --inputs DIR's chain.npz, mlp's test_data_set_0.
    chain_report = json.loads((zoo / "out" / "chain" / "faulty" / "report.json").read_text())
    assert "--input" in chain_report["command"] and "chain.npz" in chain_report["command"]
    assert "test_data_set_0" in report["command"]
    assert first.failed and first.case("residual", "aborts") is not None


def test_junit_has_a_testcase_per_case_with_the_root_cause_and_repro(zoo: Path) -> None:
    tree = ET.parse(zoo / "out" / "junit.xml")
    cases = tree.getroot().findall(".//testcase")
    assert len(cases) == 12
    failed = {
        (c.get("classname"), c.get("name")): c[0] for c in cases if len(c) and c[0].tag != "skipped"
    }
    assert set(failed) == {("faulty", "mlp"), ("aborts", "residual")}
    assert failed[("faulty", "mlp")].tag == "failure"
    assert failed[("aborts", "residual")].tag == "error"
    text = failed[("faulty", "mlp")].text or ""
    assert text.splitlines()[0] == (
        "diverged (numerics) at /relu/Relu: Relu '/relu/Relu' diverges on its own when fed the "
        "reference's inputs (rel_l2=0.05 > threshold "
        + text.split("threshold ")[1].split(")")[0]
        + ")"
    )
    assert f"repro: bisect {zoo}/models/mlp/mlp.onnx --ref cpu --target 'exec:" in text


def test_summary_matrix_tally_and_links(zoo: Path) -> None:
    md = (zoo / "out" / "summary.md").read_text()
    assert "| model | faulty | aborts |" in md
    assert (
        "| mlp | [diverged at /relu/Relu](mlp/faulty/report.md) | [agree](mlp/aborts/report.md) |"
        in md
    )
    assert "- aborts: 1 model stop at Add (crash: residual)" in md
    assert "- faulty: 1 model stop at Relu (diverged: mlp)" in md
    html = (zoo / "out" / "summary.html").read_text()
    assert "Content-Security-Policy" in html and "<script src" not in html
    assert '<a href="mlp/faulty/report.html">diverged at /relu/Relu</a>' in html
    assert '<a href="mlp/faulty/repro/">bundle</a>' in html


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "onnx-bisect"), "sweep", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )


def test_console_script_against_the_baseline_exits_0_then_1_on_a_new_fault(
    first: SweepResult, zoo: Path
) -> None:
    """The real console script, resuming the first sweep's folder: unchanged failures pass the
    gate; a fault planted in another model (the exec: target's spec changes, so its six cases
    run again) is a new regression, named with its node."""
    common = [str(zoo / "models"), "--inputs", str(zoo / "inputs"), "--resume", "--jobs", "2"]
    baseline = ["--baseline", str(zoo / "baseline.json")]
    same = _cli(*common, *[f"--target={t}" for t in TARGETS], "--out", str(zoo / "out"), *baseline)
    assert same.returncode == 0, same.stderr
    assert "Unchanged failures (2)" in (zoo / "out" / "summary.md").read_text()
    worse = _cli(
        *common,
        f"--target={faulty(FAULT_NODE, NEW_FAULT)}",
        f"--target={CRASHING}",
        "--out",
        str(zoo / "out"),
        *baseline,
    )
    assert worse.returncode == 1, worse.stderr
    assert f"conv_bn x faulty: diverged at {NEW_FAULT}" in worse.stdout
    assert "new regressions (1): conv_bn x faulty" in worse.stdout
    summary = (zoo / "out" / "summary.md").read_text()
    assert (
        "## New regressions (1)\n\n- conv_bn x faulty: agree -> diverged at stage1/sigmoid"
        in summary
    )
    assert "## Unchanged failures (2)" in summary
    junit = ET.parse(zoo / "out" / "junit.xml").getroot()
    assert [e.tag for e in junit.iter() if e.tag in ("failure", "error")] == ["failure"]
    # Resume ran only the six cases of the changed target: the crash case was read back.
    assert worse.stdout.count("] ") == 6


def test_resume_redoes_no_finished_case(zoo: Path, tmp_path: Path) -> None:
    models = [zoo / "models" / "chain.onnx", zoo / "models" / "two_inputs.onnx"]
    out = tmp_path / "out"
    onnx_bisect.sweep(models, ["cpu"], out=out, inputs=zoo / "inputs")
    (out / "two_inputs" / "cpu" / "case.json").unlink()  # as if killed while it ran
    again: list[CaseResult] = []
    result = onnx_bisect.sweep(
        models, ["cpu"], out=out, inputs=zoo / "inputs", resume=True, on_case=again.append
    )
    assert [c.key for c in again] == [("two_inputs", "cpu")]
    assert result.resumed == (("chain", "cpu"),)
    assert [c.outcome for c in result.cases] == [CaseOutcome.AGREE] * 2
    assert len(_rows(out)) == 2
    # A sweep of fewer models keeps the others' folders the tool's (its manifest), so a later
    # sweep of them all is not refused.
    onnx_bisect.sweep(models[:1], ["cpu"], out=out, resume=True)
    again.clear()
    onnx_bisect.sweep(models, ["cpu"], out=out, inputs=zoo / "inputs", resume=True)
    assert not again


@pytest.mark.slow
def test_a_case_past_its_timeout_is_a_hang_and_the_sweep_goes_on(zoo: Path, tmp_path: Path) -> None:
    slow = (
        f"slow=exec:{sys.executable} {FAULTY_RUNTIME} {{model}} {{inputs}} {{outputs}} --sleep 120"
    )
    result = onnx_bisect.sweep(
        [zoo / "models" / "chain.onnx"], [slow, "cpu"], out=tmp_path, case_timeout=25
    )
    hang, fine = result.cases
    assert (hang.outcome, hang.stage) == (CaseOutcome.HANG, Stage.RUN)
    assert hang.reason == "the case ran past its timeout of 25 s and was killed"
    assert 25 <= hang.seconds < 40
    assert fine.outcome is CaseOutcome.AGREE
    assert result.failed


def test_usage_errors_are_one_line_exit_2(tmp_path: Path) -> None:
    proc = _cli(str(tmp_path / "none.onnx"), "--target", "cpu", "--out", str(tmp_path / "o"))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: {tmp_path}/none.onnx: no such model file or folder"
    ]
    proc = _cli(str(CONV_BN), "--target", "nosuch", "--out", str(tmp_path / "o"))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "nosuch" in proc.stderr


def test_specs_are_checked_before_any_case_runs(tmp_path: Path) -> None:
    from onnx_bisect.errors import SpecError

    with pytest.raises(SpecError, match="unknown backend 'nosuch'"):
        onnx_bisect.sweep([CONV_BN], ["cpu"], ref="nosuch", out=tmp_path)
    with pytest.raises(InputError, match="ray must be 'local' or a cluster address"):
        onnx_bisect.sweep([CONV_BN], ["cpu"], ray=" ", out=tmp_path)
    assert not list(tmp_path.iterdir())


def test_help_fits_80_columns() -> None:
    proc = subprocess.run(
        [str(BIN / "onnx-bisect"), "sweep", "--help"],
        capture_output=True,
        text=True,
        env=dict(os.environ, COLUMNS="80", TERM="dumb"),
        timeout=60,
    )
    assert proc.returncode == 0
    assert max(len(line) for line in proc.stdout.splitlines()) <= 80
    for flag in ("--target", "--baseline", "--write-baseline", "--resume", "--ray", "--jobs"):
        assert flag in proc.stdout


@pytest.mark.slow
def test_ray_local_gives_the_same_results(first: SweepResult, zoo: Path, tmp_path: Path) -> None:
    pytest.importorskip("ray")
    result = onnx_bisect.sweep(
        [zoo / "models"], TARGETS, out=tmp_path, inputs=zoo / "inputs", ray="local", jobs=2
    )

    def table(r: SweepResult) -> list[tuple[object, ...]]:
        return [(c.key, c.outcome, c.stage, c.root_nodes, c.first_divergence) for c in r.cases]

    assert table(result) == table(first)
    # The files came back from the workers into the sweep's folder.
    assert (tmp_path / "mlp" / "faulty" / "repro" / "model.onnx").is_file()
    assert (tmp_path / "residual" / "aborts" / "report.json").is_file()
    assert len(_rows(tmp_path)) == 12


# --- the pure parts ------------------------------------------------------------------------


def test_worse_is_the_order_of_outcomes() -> None:
    o = CaseOutcome
    assert is_worse(o.AGREE, o.PRECISION) and is_worse(o.AGREE, o.DIVERGED)
    assert is_worse(o.PRECISION, o.DIVERGED) and is_worse(o.DIVERGED, o.CRASH)
    assert is_worse(o.UNSUPPORTED, o.HANG)
    assert not is_worse(o.PRECISION, o.AGREE) and not is_worse(o.CRASH, o.DIVERGED)
    assert not is_worse(o.DIVERGED, o.UNSUPPORTED) and not is_worse(o.HANG, o.ERROR)


def _row(model: str, outcome: CaseOutcome) -> CaseResult:
    return CaseResult(model=model, target="t", outcome=outcome, stage=Stage.NUMERICS)


def test_baseline_changes() -> None:
    o = CaseOutcome
    before = {("a", "t"): o.AGREE, ("b", "t"): o.DIVERGED, ("c", "t"): o.CRASH}
    now = [_row("a", o.DIVERGED), _row("b", o.AGREE), _row("c", o.DIVERGED), _row("d", o.HANG)]
    diff = compare_baseline(now, before, "b.json")
    assert diff.keys(Change.REGRESSION) == [("a", "t"), ("d", "t")]
    assert diff.keys(Change.FIXED) == [("b", "t")]
    assert diff.keys(Change.UNCHANGED) == [("c", "t")]


def test_target_labels_and_slugs() -> None:
    assert slug("openvino") == "openvino"
    assert slug("ort?opt=basic") == "ort-opt-basic-" + slug("ort?opt=basic").rsplit("-", 1)[1]
    long = slug("exec:/usr/bin/python run.py {model} {inputs} {outputs} --fast")
    assert len(long) <= 40 and long.startswith("exec-usr-bin-python-run.py-mod")
    labelled = parse_targets(["ov=openvino", "cpu"])
    assert [(t.label, t.spec, t.slug) for t in labelled] == [
        ("ov", "openvino", "ov"),
        ("cpu", "cpu", "cpu"),
    ]
    with pytest.raises(InputError, match="target: 'cpu' names two targets"):
        parse_targets(["cpu", "cpu"])


_CASE = Case(
    model=ModelEntry(name="m", path=Path("m.onnx"), inputs=None),
    target=TargetEntry(label="t", spec="cpu", slug="t"),
)


@pytest.mark.parametrize(
    ("error", "stage"),
    [
        ({"class": "ModelLoadError", "message": "m.onnx: not an ONNX model"}, Stage.LOAD),
        ({"class": "ModelLoadError", "message": "transform +fp16 failed: x"}, Stage.CONVERT),
        ({"class": "BackendUnavailableError", "message": "openvino: not installed"}, Stage.LOAD),
        ({"class": "BackendError", "message": "cpu: failed"}, Stage.RUN),
    ],
)
def test_an_error_s_class_gives_its_stage(error: dict[str, str], stage: Stage) -> None:
    row = from_error(_CASE, 2, error, "", where="m/t")
    assert (row.outcome, row.stage) == (CaseOutcome.ERROR, stage)
    assert row.reason == f"{error['message']} (exit 2, {error['class']})"


def test_a_signal_without_a_report_is_a_crash_named_by_its_signal() -> None:
    row = from_signal(_CASE, -11, hung=False, report=None, where="m/t")
    assert (row.outcome, row.reason) == (CaseOutcome.CRASH, "the case's process died by SIGSEGV")


def _report(kind: str, reason: str = "r", compiles: bool = False) -> dict[str, object]:
    return {
        "verdict": "diverged",
        "root_cause": {"kind": kind, "nodes": ["n1"], "reason": reason},
        "first_divergence": {"node": "n1"},
        "nodes": [{"node": "n1", "op_type": "Pad"}],
        "target": {"compiles": compiles},
        "repro": None,
    }


@pytest.mark.parametrize(
    ("kind", "reason", "compiles", "outcome", "stage"),
    [
        ("culprit", "r", False, CaseOutcome.DIVERGED, Stage.NUMERICS),
        ("pattern", "r", False, CaseOutcome.DIVERGED, Stage.NUMERICS),
        ("precision", "r", False, CaseOutcome.PRECISION, Stage.NUMERICS),
        ("quantization", "r", False, CaseOutcome.PRECISION, Stage.NUMERICS),
        ("unsupported", "r", False, CaseOutcome.UNSUPPORTED, Stage.CONVERT),
        ("unsupported", "r", True, CaseOutcome.UNSUPPORTED, Stage.COMPILE),
        ("crash", "the target crashes whenever", False, CaseOutcome.CRASH, Stage.RUN),
        ("crash", "the target hangs (timed out after 2 s)", False, CaseOutcome.HANG, Stage.RUN),
        ("error", "r", True, CaseOutcome.ERROR, Stage.COMPILE),
    ],
)
def test_a_report_s_root_cause_gives_outcome_and_stage(
    kind: str, reason: str, compiles: bool, outcome: CaseOutcome, stage: Stage
) -> None:
    row = from_report(_CASE, _report(kind, reason, compiles), where="m/t")
    assert (row.outcome, row.stage, row.root_kind) == (outcome, stage, kind)
    assert (row.root_nodes, row.root_ops, row.first_divergence) == (("n1",), ("Pad",), "n1")
    assert (row.report, row.bundle) == ("m/t/report.md", "")


def test_a_crash_the_isolated_run_names_keeps_its_node() -> None:
    report = _report("crash", "the target crashes whenever Add 'n1' is in the model")
    row = from_signal(_CASE, -6, hung=False, report=report, where="m/t")
    assert (row.outcome, row.root_nodes, row.stage) == (CaseOutcome.CRASH, ("n1",), Stage.RUN)
    agreed = {"verdict": "match", "root_cause": None, "first_divergence": None}
    row = from_signal(_CASE, -6, hung=False, report=agreed, where="m/t")
    assert row.outcome is CaseOutcome.CRASH
    assert (
        row.reason == "the case's process died by SIGABRT; run again with --isolate-crashes: agree"
    )


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs: a zombie (dead, not yet reaped by whoever adopted it) does not."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat[stat.rindex(")") + 2] != "Z"


@pytest.mark.slow
def test_ctrl_c_ends_every_case_under_way(zoo: Path, tmp_path: Path) -> None:
    """Each case runs in a session of its own, which the terminal's Ctrl-C does not reach: the
    sweep ends them itself (and their runtimes with them), and runs no case again."""
    mark = tmp_path / "runs.txt"
    slow = (
        f"slow=exec:{sys.executable} {FAULTY_RUNTIME} {{model}} {{inputs}} {{outputs}} "
        f"--sleep 120 --mark {mark}"
    )
    models = [str(zoo / "models" / f"{name}.onnx") for name in ("chain", "residual", "with_if")]
    proc = subprocess.Popen(
        [str(BIN / "onnx-bisect"), "sweep", *models, "-t", slow, "-o", str(tmp_path / "o")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (mark.is_file() and mark.read_text().count("\n") >= 1):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130 and err.strip().splitlines()[-1] == "interrupted"
    pids = [int(line.split()[0]) for line in mark.read_text().splitlines()]
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in pids if _alive(pid)]
    assert len(pids) == 1  # the cases queued behind it never started
    assert not list((tmp_path / "o").glob("*/*/case.json"))


def test_ray_resources_follow_the_target_and_the_budget() -> None:
    from onnx_bisect.cases.plan import CaseOptions
    from onnx_bisect.cases.remote import _resources

    def case(spec: str) -> Case:
        return Case(model=_CASE.model, target=TargetEntry(label="t", spec=spec, slug="t"))

    assert _resources(case("cpu"), options=CaseOptions()) == {}
    assert _resources(case("cuda"), options=CaseOptions()) == {"num_gpus": 1}
    assert _resources(case("torch:cuda:0"), options=CaseOptions(max_memory=1 << 30)) == {
        "num_gpus": 1,
        "memory": (1 << 30) + (600 << 20),
    }


def test_models_under_the_output_folder_are_not_swept(tmp_path: Path) -> None:
    from onnx_bisect.cases.plan import find_models

    onnx.save(chain(), tmp_path / "chain.onnx")
    (tmp_path / "out" / "chain" / "cpu" / "repro").mkdir(parents=True)
    onnx.save(chain(), tmp_path / "out" / "chain" / "cpu" / "repro" / "model.onnx")
    (tmp_path / "zoo" / "a").mkdir(parents=True)
    (tmp_path / "zoo" / "b").mkdir()
    onnx.save(chain(), tmp_path / "zoo" / "a" / "model.onnx")
    onnx.save(mlp(), tmp_path / "zoo" / "b" / "model.onnx")
    found = find_models([tmp_path], out=tmp_path / "out")
    assert [(m.name, m.path.relative_to(tmp_path).as_posix()) for m in found] == [
        ("chain", "chain.onnx"),
        ("a-model", "zoo/a/model.onnx"),
        ("b-model", "zoo/b/model.onnx"),
    ]
