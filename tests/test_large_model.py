"""Over 2 GB end to end (issue 14): a model with 2.5 GiB of external-data weights, generated
here and deleted after, in which a planted fault is named and a verified bundle written, with
the peak RSS of the whole process tree measured; and a model over 2 GB in memory, sized
without serializing it.

Slow (about 1.5 min on 2 cores) and heavy (2.7 GB of disk, 6 GiB of RAM at peak).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import onnx
import pytest

from onnx_bisect.graph.load import load_model
from onnx_bisect.graph.sizes import PROTO_LIMIT, model_bytes
from tests.models import FAULTY_RUNTIME, ROOT, write_external_mlp

psutil = pytest.importorskip("psutil")

pytestmark = pytest.mark.slow

FAULT = "mm2"
# 5 blocks of MatMul (8192x16384 or 16384x8192 float32: 512 MiB each), Add, Relu: 15 nodes.
BLOCKS, WIDTH, HIDDEN = 5, 8192, 16384


@pytest.fixture(scope="module")
def large(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    directory = tmp_path_factory.mktemp("large")
    path = directory / "model.onnx"
    write_external_mlp(path, blocks=BLOCKS, width=WIDTH, hidden=HIDDEN)
    yield path
    shutil.rmtree(directory)  # pytest keeps its last tmp dirs; 2.7 GB must not stay


@dataclass(frozen=True)
class Run:
    code: int
    stdout: str
    stderr: str
    seconds: float
    peak_tree: int  # bytes: the largest sum of RSS over the process and its descendants
    peak_main: int


def _bisect(args: Sequence[str], cwd: Path) -> Run:
    """The ``bisect`` console entry in a fresh interpreter, its process tree sampled every
    50 ms (a sample can miss a peak between two, never invent one)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    code = "import sys; from onnx_bisect.cli import bisect_entry; bisect_entry(sys.argv[1:])"
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    peaks = [0, 0]
    done = threading.Event()

    def sample() -> None:
        root = psutil.Process(proc.pid)
        while not done.is_set():
            try:
                family = [root, *root.children(recursive=True)]
                main = root.memory_info().rss
            except psutil.Error:
                break
            tree = 0
            for p in family:
                try:
                    tree += p.memory_info().rss
                except psutil.Error:
                    continue  # it exited between the listing and the read
            peaks[0], peaks[1] = max(peaks[0], tree), max(peaks[1], main)
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stdout, stderr = proc.communicate(timeout=600)
    done.set()
    sampler.join()
    return Run(proc.returncode, stdout, stderr, time.monotonic() - start, peaks[0], peaks[1])


def _faulty(*extra: str) -> str:
    argv = [sys.executable, str(FAULTY_RUNTIME), "{model}", "{inputs}", "{outputs}", *extra]
    return "exec:" + shlex.join(argv)


def test_planted_fault_in_a_model_over_2gb(large: Path, tmp_path: Path) -> None:
    size = model_bytes(load_model(large).model)
    assert size.external > 2**31 and size.message < 1 << 20
    out = large.parent / "out"  # removed with the model: the bundle holds 512 MiB
    # 1%: at default settings that needs the float64 oracle's noise floors (the fallback's
    # fixed 1e-3 misses such faults once they reach the outputs diluted, issue 28).
    args = [str(large), "--target", _faulty("--fault", f"{FAULT}=0.01"), "--out", str(out)]
    run = _bisect(args, tmp_path)
    gib = 2**30
    print(
        f"\n2.5 GiB model, planted fault: {run.seconds:.1f} s, peak RSS {run.peak_tree / gib:.2f} "
        f"GiB process tree, {run.peak_main / gib:.2f} GiB main process"
    )
    assert run.code == 1, run.stderr
    assert f"Root cause (culprit): {FAULT}" in run.stdout
    report = json.loads((out / "report.json").read_text())
    assert report["first_divergence"]["node"] == FAULT
    assert report["root_cause"]["nodes"] == [FAULT]
    assert any("float64 values from torch" in n for n in report["notes"]), report["notes"]
    assert report["repro"]["reproduces"] is True and report["repro"]["nodes"] == [FAULT]
    bundle = out / "repro"
    readme = (bundle / "README.md").read_text()
    assert "- verified: re-run in a fresh process, it reproduces" in readme
    # The bundle holds a copy of the one weight its node reads (W2, 512 MiB), not the model's.
    data = bundle / "model.onnx.data"
    assert data.stat().st_size == WIDTH * HIDDEN * 4 and data.stat().st_nlink == 1
    # The weights are held by the reference (ONNX Runtime in the tool's process: a packed
    # copy) and the target, one at a time: two copies do not fit the default budget
    # (MemoryPlan.side_by_side). Measured: 3.17 GiB tree, 1.27x the weights (main 3.10 GiB);
    # side by side it was 2.3x.
    assert run.peak_main < 1.5 * size.weights
    assert run.peak_tree < 1.75 * size.weights


def test_no_divergence_on_the_same_runtime(large: Path, tmp_path: Path) -> None:
    run = _bisect([str(large), "--target", "cpu"], tmp_path)
    assert run.code == 0, run.stderr
    assert run.stdout.startswith("No divergence: cpu vs cpu")


def test_an_in_memory_model_over_2gb_is_sized_without_serializing() -> None:
    """ByteSize() itself raises past 2 GB; model_bytes reads lengths only."""
    model = onnx.ModelProto()
    block = bytes(720 << 20)
    for i in range(3):
        t = model.graph.initializer.add(name=f"w{i}", data_type=onnx.TensorProto.UINT8)
        t.dims.append(len(block))
        t.raw_data = block
    del block
    with pytest.raises(Exception, match="Failed to serialize proto"):
        model.ByteSize()
    size = model_bytes(model)
    assert size.inline_data == 3 * (720 << 20) and size.external == 0
    assert size.message > PROTO_LIMIT and not size.fits


@pytest.mark.parametrize("transform", ["fp16", "opset=19", "onnxoptimizer"])
def test_transforms_above_2gb(large: Path, transform: str) -> None:
    """onnxconverter-common's own shape inference serializes the model ("Failed to serialize
    proto" past 2 GB), and so do the version converter and onnxoptimizer: the child infers
    shapes on the message without its weights, converts versions without reading them, and
    hands onnxoptimizer files (issue 28)."""
    from onnx_bisect.transforms.apply import apply_transforms

    loaded = load_model(large)
    converted, (record,) = apply_transforms(loaded.model, [transform], "target")
    assert record.nodes_before == len(loaded.model.graph.node)
    weights = {t.name: t for t in converted.graph.initializer}
    if transform == "fp16":
        assert weights["W2"].data_type == onnx.TensorProto.FLOAT16
        assert len(weights["W2"].raw_data) == WIDTH * HIDDEN * 2
    elif transform.startswith("opset"):
        assert next(o.version for o in converted.opset_import if o.domain == "") == 19
        assert len(weights["W2"].raw_data) == WIDTH * HIDDEN * 4
    else:
        assert record.nodes_after <= record.nodes_before
        assert len(weights["W2"].raw_data) == WIDTH * HIDDEN * 4
    del converted, weights
