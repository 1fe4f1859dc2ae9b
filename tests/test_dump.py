"""dump:DIR — tensors dumped on one machine, compared on another."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import onnx_bisect
from onnx_bisect import Verdict
from onnx_bisect.backends.dump import file_name, tensor_name
from onnx_bisect.cli import app
from onnx_bisect.dumper import dump
from tests.models import FAULTY_RUNTIME, YOLO

FAULT = "/down1/conv/Conv"


def faulty() -> str:
    cmd = [sys.executable, str(FAULTY_RUNTIME), "{model}", "{inputs}", "{outputs}"]
    return "exec:" + shlex.join([*cmd, "--fault", f"{FAULT}=0.05"])


@pytest.mark.parametrize("name", ["/model.0/conv/Conv_output_0", "a:b", "x y", "ü", "..", "%2F"])
def test_file_names_round_trip(name: str) -> None:
    f = file_name(name)
    assert "/" not in f and f.endswith(".npy")
    assert tensor_name(f) == name


def test_dumped_reference_gives_the_same_first_divergence(tmp_path: Path) -> None:
    pytest.importorskip("openvino")
    done = dump(YOLO, "cpu", tmp_path / "cpu")
    assert done.tensors == 197 and (tmp_path / "cpu" / "manifest.json").is_file()
    direct = onnx_bisect.bisect(YOLO, ref="cpu", target="openvino")
    offline = onnx_bisect.bisect(YOLO, ref=f"dump:{tmp_path / 'cpu'}", target="openvino")
    assert direct.verdict == offline.verdict == "diverged"
    assert direct.first_divergence is not None and offline.first_divergence is not None
    assert offline.first_divergence.name == direct.first_divergence.name
    assert offline.root_cause == direct.root_cause


def test_dumped_target_is_compared_and_verdicts_are_derived(tmp_path: Path) -> None:
    dump(YOLO, faulty(), tmp_path / "bad")
    result = onnx_bisect.bisect(YOLO, ref="cpu", target=f"dump:{tmp_path / 'bad'}")
    assert result.verdict == "diverged"
    assert result.first_divergence is not None and result.first_divergence.name == FAULT
    assert result.root_cause is not None and result.root_cause.nodes == (FAULT,)
    assert "derived from a dump" in result.root_cause.reason
    assert all(n.isolated is None for n in result.nodes)  # nothing can run a dump
    assert any("the target is a dump" in n for n in result.notes)
    downstream = [n for n in result.nodes if n.diverged and n.name != FAULT]
    assert downstream and all(n.verdict is Verdict.PROPAGATED for n in downstream)


def test_partial_dumps_and_npz_dumps(tmp_path: Path) -> None:
    full = tmp_path / "full"
    dump(YOLO, "cpu", full)
    part = tmp_path / "part"
    part.mkdir()
    keep = sorted(full.glob("*.npy"))[:40] + [full / "inputs.npz"]
    for f in keep:
        (part / f.name).write_bytes(f.read_bytes())
    (part / file_name("output0")).write_bytes((full / file_name("output0")).read_bytes())
    result = onnx_bisect.bisect(YOLO, ref="cpu", target=f"dump:{part}", always_scan=True)
    assert result.verdict == "match"
    compared = [n for n in result.nodes if n.accumulated is not None]
    assert 0 < len(compared) < len(result.nodes)  # missing tensors are not mismatches
    arrays = {tensor_name(f.name): np.load(f) for f in full.glob("*.npy")}
    np.savez(tmp_path / "all.npz", **arrays)  # type: ignore[arg-type]
    z = onnx_bisect.bisect(
        YOLO, ref="cpu", target=f"dump:{tmp_path / 'all.npz'}", inputs=full / "inputs.npz"
    )
    assert z.verdict == "match"


def test_dump_cli_and_errors(tmp_path: Path) -> None:
    runner = CliRunner()
    res = runner.invoke(app, ["dump", str(YOLO), "-b", "cpu", "-o", str(tmp_path / "d")])
    assert res.exit_code == 0 and "197 tensors from cpu" in res.stdout
    res = runner.invoke(app, ["run", str(YOLO), "-t", f"dump:{tmp_path / 'nowhere'}"])
    assert res.exit_code == 2 and "no dump at" in res.stderr
