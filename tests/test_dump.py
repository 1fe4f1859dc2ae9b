"""dump:DIR — tensors dumped on one machine, compared on another."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
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
from tests.models import FAULTY_RUNTIME, TRANSFORMER, YOLO

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
    # A fixed threshold: OpenVINO's bf16 default is then a divergence with culprits (at auto,
    # its precision floors explain it and name no node, tests/test_lowered.py).
    direct = onnx_bisect.bisect(YOLO, ref="cpu", target="openvino", threshold=1e-4)
    offline = onnx_bisect.bisect(
        YOLO, ref=f"dump:{tmp_path / 'cpu'}", target="openvino", threshold=1e-4
    )
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


def test_a_dump_directory_holds_one_dump(tmp_path: Path) -> None:
    """A dump replaces an earlier dump as a set; a directory with other files is refused."""
    d = tmp_path / "d"
    dump(YOLO, "cpu", d)
    done = dump(TRANSFORMER, "cpu", d)
    manifest = json.loads((d / "manifest.json").read_text())
    assert manifest["model"] == str(TRANSFORMER)
    files = {p.name for p in d.iterdir()}
    assert files == {"manifest.json", "inputs.npz", *manifest["tensors"].values()}
    assert len(files) == done.tensors + 2  # nothing of the YOLO dump is left
    (d / "notes.txt").write_text("mine\n")
    res = CliRunner().invoke(app, ["dump", str(YOLO), "-b", "cpu", "-o", str(d)])
    assert res.exit_code == 2 and len(res.stderr.splitlines()) == 1
    assert "holds 1 file(s) that are not part of an onnx-bisect dump (notes.txt)" in res.stderr
    assert {p.name for p in d.iterdir()} == files | {"notes.txt"}  # untouched


def test_a_dump_of_another_model_is_named_as_such(tmp_path: Path) -> None:
    other = tmp_path / "transformer"
    dump(TRANSFORMER, "cpu", other)
    runner = CliRunner()
    for args in (
        ["dump", str(YOLO), "--backend", f"dump:{other}", "-o", str(tmp_path / "copy")],
        ["run", str(YOLO), "--target", f"dump:{other}"],
        ["run", str(YOLO), "--ref", f"dump:{other}", "--target", "cpu"],
    ):
        res = runner.invoke(app, args)
        assert res.exit_code == 2, res.output
        assert res.stderr.startswith(f"error: dump:{other} does not fit this model: unknown ")
        assert "a dump of another model?" in res.stderr and "internal error" not in res.stderr
    # Without recorded inputs (an .npz of tensors), the tensor names tell.
    np.savez(tmp_path / "t.npz", x=np.zeros(3, np.float32))
    res = runner.invoke(app, ["run", str(YOLO), "--target", f"dump:{tmp_path / 't.npz'}"])
    assert res.exit_code == 2 and "holds none of this model's tensors (it holds x)" in res.stderr


def test_a_shape_agreeing_with_the_dump_is_accepted(tmp_path: Path) -> None:
    d = tmp_path / "cpu"
    dump(YOLO, "cpu", d)
    runner = CliRunner()
    res = runner.invoke(app, ["run", str(YOLO), "-t", f"dump:{d}", "--shape", "images=1x3x160x160"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["run", str(YOLO), "-t", f"dump:{d}", "--shape", "images=1x3x64x64"])
    assert res.exit_code == 2
    assert res.stderr.startswith(
        f"error: --shape images=1x3x64x64 disagrees with the inputs recorded in dump:{d} "
        "(it holds 1x3x160x160)"
    )


def test_a_bundle_against_a_dump_carries_what_it_needs(tmp_path: Path) -> None:
    """The reference was a dump: the bundle reads it from its own expected outputs, so the
    bundle still runs after the dump is deleted and the bundle moved elsewhere."""
    d = tmp_path / "cpu"
    dump(YOLO, "cpu", d)
    bundle = tmp_path / "bundle"
    result = onnx_bisect.bisect(YOLO, ref=f"dump:{d.resolve()}", target=faulty(), repro=bundle)
    assert result.repro is not None and result.repro.reproduces, result.repro
    script = (bundle / "repro.py").read_text()
    # The dump's path is in the title only (what was compared), not in any setting.
    assert 'REF = "dump:test_data_set_0"' in script and f'"dump:{d.resolve()}' not in script
    shutil.rmtree(d)
    moved = tmp_path / "elsewhere" / "b"
    moved.parent.mkdir()
    bundle.rename(moved)
    proc = subprocess.run(
        [sys.executable, str(moved / "repro.py")], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "reference  dump:test_data_set_0: matches expected outputs" in proc.stdout
    assert "REPRODUCED" in proc.stdout


def test_a_dump_target_makes_no_bundle_and_says_why(tmp_path: Path) -> None:
    dump(YOLO, faulty(), tmp_path / "bad")
    result = onnx_bisect.bisect(
        YOLO, ref="cpu", target=f"dump:{tmp_path / 'bad'}", repro=tmp_path / "bundle"
    )
    assert result.repro is not None and not result.repro.reproduces
    assert "replays recorded tensors and cannot run a subgraph" in result.repro.message
    assert not (tmp_path / "bundle").exists()
