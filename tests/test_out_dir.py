"""``--out``: checked before any work, and replaced as a set when reused.

A file, a path under a file or an unwritable place is a one-line exit-2 error before anything
runs (the target here marks every run it makes, and none is made). A directory reused by a
later run holds that run's files only, plus whatever the user put there, which is mentioned.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from pathlib import Path

import onnx
import pytest
from typer.testing import CliRunner

from onnx_bisect.cli import app, bisect_app
from onnx_bisect.report.files import REPORT_FILES
from onnx_bisect.report.manifest import MANIFEST, manifest_text
from onnx_bisect.report.outdir import check_out_dir, replace_owned, staging_dir
from onnx_bisect.repro.bundle import BUNDLE_FILES
from tests.models import FAULTY_RUNTIME, chain

# A bundle of a model whose weights are in the message has no model.onnx.data.
INLINE_BUNDLE = sorted(set(BUNDLE_FILES) - {"model.onnx.data"})


def _faulty(marks: Path) -> str:
    cmd = [sys.executable, str(FAULTY_RUNTIME), "{model}", "{inputs}", "{outputs}"]
    return "exec:" + shlex.join([*cmd, "--fault", "mm1=0.05", "--mark", str(marks)])


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "chain.onnx"
    onnx.save(chain(4), path)
    return path


def _unwritable(tmp_path: Path) -> Path:
    """A place no directory can be made in, for this user: root writes through permissions,
    but not into sysfs."""
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o555)
        return locked / "out"
    if not Path("/sys/kernel").is_dir():
        pytest.skip("running as root without sysfs: no unwritable place to point at")
    return Path("/sys/onnx-bisect-out")


CASES = {
    "a file": (lambda tmp: _touch(tmp / "report.txt"), "is a file, not a directory"),
    "under a file": (lambda tmp: _touch(tmp / "report.txt") / "out", "is a file, so no directory"),
    "unwritable": (_unwritable, "cannot write in"),
}


def _touch(path: Path) -> Path:
    path.write_text("not a directory\n")
    return path


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("command", ["bisect", "run", "reduce", "dump"])
def test_a_bad_out_is_one_line_before_any_run(
    tmp_path: Path, model: Path, case: str, command: str
) -> None:
    make, expected = CASES[case]
    out = make(tmp_path)
    marks = tmp_path / "marks"
    target = _faulty(marks)
    runner = CliRunner()
    started = time.monotonic()
    if command == "bisect":
        res = runner.invoke(bisect_app, [str(model), "-t", target, "-o", str(out)])
    elif command == "dump":
        res = runner.invoke(app, ["dump", str(model), "-b", target, "-o", str(out)])
    else:
        res = runner.invoke(app, [command, str(model), "-t", target, "-o", str(out)])
    elapsed = time.monotonic() - started
    assert res.exit_code == 2, res.output
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --out {out}: "), res.stderr
    assert expected in lines[0] and "Traceback" not in res.output
    assert not marks.exists()  # the target never ran
    assert elapsed < 5


def test_a_reused_out_holds_the_last_run_only_and_the_users_files(
    tmp_path: Path, model: Path
) -> None:
    out = tmp_path / "out"
    runner = CliRunner()
    bad = runner.invoke(bisect_app, [str(model), "-t", _faulty(tmp_path / "marks"), "-o", str(out)])
    assert bad.exit_code == 1, bad.output
    assert sorted(p.name for p in out.iterdir()) == sorted([MANIFEST, *REPORT_FILES])
    (out / "notes.txt").write_text("mine\n")
    (out / "plots").mkdir()
    clean = runner.invoke(bisect_app, [str(model), "-t", "cpu", "-o", str(out), "-f", "md,json"])
    assert clean.exit_code == 0, clean.output
    # No stale bundle, nodes.csv or verdict: the set was replaced; the user's entries stayed.
    names = sorted(p.name for p in out.iterdir())
    assert names == [MANIFEST, "inputs.npz", "notes.txt", "plots", "report.json", "report.md"]
    assert json.loads((out / "report.json").read_text())["verdict"] == "match"
    assert "No divergence" in (out / "report.md").read_text()
    assert (out / "notes.txt").read_text() == "mine\n"
    assert f"kept 2 file(s) in {out}/ that onnx-bisect did not write: notes.txt, plots" in (
        clean.stdout
    )
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_the_report_names_the_bundle_where_it_lies(tmp_path: Path, model: Path) -> None:
    """The bundle is written in a staging directory; the reports name its final place."""
    out = tmp_path / "out"
    res = CliRunner().invoke(
        bisect_app, [str(model), "-t", _faulty(tmp_path / "m"), "-o", str(out)]
    )
    assert res.exit_code == 1, res.output
    report = json.loads((out / "report.json").read_text())
    assert report["repro"]["path"] == str(out / "repro") and report["repro"]["reproduces"]
    assert f"`{out / 'repro'}`" in (out / "report.md").read_text()
    assert sorted(p.name for p in (out / "repro").iterdir()) == INLINE_BUNDLE


def test_reduce_replaces_a_bundle_and_keeps_the_rest(tmp_path: Path, model: Path) -> None:
    out = tmp_path / "bundle"
    runner = CliRunner()
    res = runner.invoke(app, ["reduce", str(model), "-t", _faulty(tmp_path / "m"), "-o", str(out)])
    assert res.exit_code == 1, res.output
    assert sorted(p.name for p in out.iterdir()) == [MANIFEST, *INLINE_BUNDLE]
    (out / "notes.txt").write_text("mine\n")
    res = runner.invoke(app, ["reduce", str(model), "-t", "cpu", "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert "No divergence: nothing to reduce." in res.stdout
    assert sorted(p.name for p in out.iterdir()) == [MANIFEST, "notes.txt"]
    assert f"kept 1 file(s) in {out}/" in res.stdout


def test_replace_owned_swaps_the_set(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    for name in ("a.txt", "b.txt", "user.txt"):
        (out / name).write_text("old")
    (out / MANIFEST).write_text(manifest_text(["a.txt", "b.txt"]))  # an earlier run's
    with staging_dir(out) as stage:
        assert stage.parent == tmp_path and stage.name.startswith(".out.onnx-bisect-")
        (stage / "a.txt").write_text("new")
        (stage / "c").mkdir()
        done = replace_owned(stage, out, owned=("a.txt", "b.txt", "c"))
    assert not stage.exists()
    assert (done.written, done.removed, done.kept) == (("a.txt", "c"), ("b.txt",), ("user.txt",))
    assert sorted(p.name for p in out.iterdir()) == [MANIFEST, "a.txt", "c", "user.txt"]
    assert json.loads((out / MANIFEST).read_text())["entries"] == ["a.txt", "c"]
    assert (out / "a.txt").read_text() == "new" and (out / "user.txt").read_text() == "old"


def test_a_failed_run_leaves_out_as_it_was(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.md").write_text("earlier")
    with pytest.raises(RuntimeError), staging_dir(out) as stage:
        (stage / "report.md").write_text("half")
        raise RuntimeError("the diagnosis failed")
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert (out / "report.md").read_text() == "earlier"


def test_check_out_dir_accepts_new_and_existing_directories(tmp_path: Path) -> None:
    check_out_dir(tmp_path)
    check_out_dir(tmp_path / "new" / "deeper")
    assert not (tmp_path / "new").exists()  # checking makes nothing
    assert [p.name for p in tmp_path.iterdir()] == []
