"""What crosses between the tool and its worker process: tensors as raw bytes in a mapped
file (backends/handover.py), and a sibling spec served by the same worker (the fp32
workaround's run, registry.create_like)."""

from __future__ import annotations

import re
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from onnx_bisect.backends.handover import read_arrays, write_arrays
from onnx_bisect.backends.registry import create_backend, create_like
from onnx_bisect.errors import BackendCrash
from tests.models import chain

PLUGIN = Path(__file__).with_name("crashing_runtime.py")


def test_every_kind_of_array_comes_back_as_it_went(tmp_path: Path) -> None:
    arrays = {
        "scalar": np.float32(3.5),
        "empty": np.zeros((0, 3), np.float64),
        "bool": np.array([True, False, True]),
        "fortran": np.asfortranarray(np.arange(12, dtype=np.int64).reshape(3, 4)),
        "bfloat16": np.array([1.5, -2.0], ml_dtypes.bfloat16),
        "int8": np.arange(-3, 4, dtype=np.int8),
        "float16": np.full((2, 2), 0.1, np.float16),
    }
    path = tmp_path / "arrays.bin"
    index = write_arrays(path, arrays)
    assert [row[0] for row in index] == list(arrays)
    assert all(offset % 64 == 0 for *_, offset in index)
    back = read_arrays(path, index)
    assert not path.exists()  # mapped, then removed: the pages live with the arrays
    for name, value in arrays.items():
        assert back[name].dtype == np.asarray(value).dtype, name
        assert back[name].shape == np.asarray(value).shape, name
        np.testing.assert_array_equal(back[name], value)
    back["int8"][0] = 100  # writeable, as a runtime's own outputs are (copy on write)
    assert back["int8"][0] == 100


def test_a_short_file_or_an_array_of_objects_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "arrays.bin"
    index = write_arrays(path, {"x": np.ones(4, np.float32)})
    with pytest.raises(ValueError, match=r"^'x' is truncated: 16 bytes in the file$"):
        read_arrays(path, [["x", "<f4", [8], 0]])
    assert index == [["x", "<f4", [4], 0]]
    with pytest.raises(ValueError, match=r"^output 's' holds Python objects \(object\)$"):
        write_arrays(path, {"s": np.array(["a", None], dtype=object)})


def _pids(notes: list[str]) -> set[str]:
    return {m.group(1) for n in notes if (m := re.match(r"ran in process (\d+)", n))}


def test_a_sibling_spec_runs_in_the_targets_worker_and_shares_its_crash() -> None:
    """The fp32 workaround's spec goes to the worker the target has: no second start, and
    contained like the target; a crash of either gives both a fresh child per run."""
    target = create_backend(f"{PLUGIN}:Crashing?node=nothing&how=exit", in_child=None)
    sibling = create_like(f"{PLUGIN}:Crashing?node=mm1&how=exit", target)
    feeds = {"x": np.ones((2, 8), np.float32)}
    target.run(chain(1), feeds)
    out = sibling.run(chain(1), feeds)  # no mm1 in a chain of one block
    assert set(out) == {"y"}
    assert _pids(target.notes()) == _pids(sibling.notes())  # one process served both
    assert len(_pids(target.notes())) == 1
    with pytest.raises(BackendCrash):
        sibling.run(chain(2), feeds)
    assert target.crashes == 1 and target.fresh  # the target's next run gets a fresh child
    target.run(chain(1), feeds)
    assert len(_pids(target.notes())) == 2


def test_a_spec_of_another_runtime_stays_in_this_process() -> None:
    target = create_backend(f"{PLUGIN}:Crashing?node=nothing", in_child=None)
    other = create_like("cpu", target)
    assert not other.capabilities.child_process


def test_the_worker_imports_our_package_not_one_in_the_working_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``python -m`` puts the working folder first: a checkout there would give the worker
    other code (another protocol) than the tool's. The worker runs with -P."""
    (tmp_path / "onnx_bisect").mkdir()
    (tmp_path / "onnx_bisect" / "__init__.py").write_text("raise ImportError('not ours')\n")
    monkeypatch.chdir(tmp_path)
    backend = create_backend("cpu", in_child=None)
    out = backend.run(chain(1), {"x": np.ones((2, 8), np.float32)})
    assert set(out) == {"y"}
