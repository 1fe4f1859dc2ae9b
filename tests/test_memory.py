"""``--max-memory``: the plan that shares the budget, and a measured bound on the whole process
tree (onnx-bisect, ONNX Runtime in it, the exec: runtime's processes) on a model whose
intermediates are several times the budget."""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

import onnx_bisect
from benchmarks.memtree import conv_net, intermediate_bytes, measure
from onnx_bisect.engine.measure.memory import FIXED_OVERHEAD, plan_memory, working_set
from onnx_bisect.engine.measure.store import TensorStore
from onnx_bisect.errors import InputError
from onnx_bisect.graph.load import load_model
from onnx_bisect.graph.sizes import fix_input_shapes, tensor_nbytes
from onnx_bisect.graph.view import LoadedModel
from tests.faulty import FaultyBackend
from tests.models import FAULTY_RUNTIME, ROOT, chain, write_external_mlp

MIB = 1 << 20
FAULT = "block10/pw"


def _sizes(
    model: onnx.ModelProto, shapes: dict[str, tuple[int, ...]]
) -> tuple[LoadedModel, dict[str, int | None]]:
    loaded = load_model(model)
    return loaded, tensor_nbytes(fix_input_shapes(loaded.model, shapes))


def test_working_set_is_the_peak_of_tensors_alive_at_once() -> None:
    # x -> MatMul -> Tanh -> ...: the input (held throughout), one node's input and its output.
    loaded, sizes = _sizes(chain(4, width=8), {"x": (2, 8)})
    assert working_set(loaded, sizes, 0) == 3 * (2 * 8 * 4)


def test_the_plan_shares_the_budget_between_what_is_kept_and_the_runs() -> None:
    size, tensor = 32, 64 * 32 * 32 * 4
    loaded, sizes = _sizes(conv_net(6, size), {"input": (1, 64, size, size)})
    plan = plan_memory(loaded, sizes, 4 * MIB, float64=True, feeds=tensor)
    # Residual blocks: the block's input, one tensor read and one written; and the model input.
    assert (plan.largest, plan.working) == (tensor, 4 * tensor)
    # The inputs, three copies of the final output; the reference's and float64 value compared.
    assert (plan.held, plan.compare) == (4 * tensor, 3 * tensor)
    assert plan.free == 4 * MIB - 7 * tensor
    assert plan.chunk() == plan.free - plan.working
    assert plan.chunk(runtimes=2) == plan.free // 2 - plan.working
    assert plan.chunk(factor=2) == (plan.free - 2 * plan.working) // 2
    assert not plan.pair  # (4 MiB - 7 tensors) / 2 - 4 tensors < 1 tensor: in turn
    assert not plan.keeps()  # 24 tensors of probes are not kept within 1/8 of 4 MiB
    roomy = plan_memory(loaded, sizes, 1 << 30, float64=True, feeds=tensor)
    assert roomy.pair and roomy.keeps(2) and roomy.held == 4 * tensor + 3 * roomy.probes


def test_a_budget_too_small_names_the_least_that_works() -> None:
    """The figure the error gives is enough: with it the planted fault is found."""
    model = conv_net(4, 16)
    with pytest.raises(InputError) as err:
        onnx_bisect.bisect(model, target=FaultyBackend("block1/pw"), max_memory=100_000)
    text = str(err.value)
    assert text.startswith("max_memory 100000 cannot hold the largest tensor, 'block0/dw.out'")
    need, alone = (int(n) for n in re.findall(r"give at least (\d+) .*, or (\d+) with", text)[0])
    assert alone < need
    result = onnx_bisect.bisect(model, target=FaultyBackend("block1/pw"), max_memory=need)
    assert result.root_cause is not None and result.root_cause.nodes == ("block1/pw",)
    fixed = onnx_bisect.bisect(
        model, target=FaultyBackend("block1/pw"), max_memory=alone, threshold=1e-3
    )
    assert fixed.root_cause is not None and fixed.root_cause.nodes == ("block1/pw",)
    with pytest.raises(InputError, match="give at least"):
        onnx_bisect.bisect(model, target="cpu", max_memory=alone)  # auto needs float64 room


def test_backends_scan_in_turn_when_a_pair_does_not_fit() -> None:
    """A budget that holds one runtime's chunk but not two: the reference runs, its values go
    to disk, then the target runs the same chunk; the verdicts are those of a roomy run."""
    model, size = conv_net(6, 32), 32
    loaded, sizes = _sizes(model, {"input": (1, 64, size, size)})
    budget = 3 * MIB
    plan = plan_memory(loaded, sizes, budget, float64=False, feeds=64 * size * size * 4)
    assert not plan.pair and plan.chunk() >= plan.largest
    tight = onnx_bisect.bisect(
        model, target=FaultyBackend("block2/dw"), max_memory=budget, threshold=1e-3
    )
    roomy = onnx_bisect.bisect(model, target=FaultyBackend("block2/dw"), threshold=1e-3)
    chunks = -(-plan.probes // plan.chunk())  # every tensor is the same size here
    assert tight.runs["ref"] == 1 + chunks and roomy.runs["ref"] == 2
    assert [n.verdict for n in tight.nodes] == [n.verdict for n in roomy.nodes]
    assert tight.root_cause is not None and tight.root_cause.nodes == ("block2/dw",)


def test_runtimes_take_turns_when_two_copies_of_the_weights_do_not_fit(tmp_path: Path) -> None:
    """Each runtime holds the weights while it runs: side by side only when the budget holds
    both copies, whatever the chunks; in turn, the planted fault is still named."""
    path = tmp_path / "model.onnx"
    write_external_mlp(path, blocks=3, width=64, hidden=256)
    loaded = load_model(path)
    sizes = tensor_nbytes(fix_input_shapes(loaded.model, {"x": (1, 64)}))
    weights = 3 * 64 * 256 * 4 + (256 + 64 + 256) * 4
    roomy = plan_memory(loaded, sizes, 1 << 20, float64=False, feeds=256)
    assert roomy.weights == weights and roomy.side_by_side and roomy.pair
    assert roomy.pair_chunk == roomy.chunk(runtimes=2) - weights  # each run holds them too
    tight = plan_memory(loaded, sizes, weights + 64 * 1024, float64=False, feeds=256)
    assert tight.chunk(runtimes=2) >= tight.largest  # the chunks alone would pair
    assert not tight.side_by_side and not tight.pair
    result = onnx_bisect.bisect(
        path, target=FaultyBackend("mm1"), max_memory=weights + 64 * 1024, threshold=1e-3
    )
    assert result.root_cause is not None and result.root_cause.nodes == ("mm1",)


def test_a_disk_store_packs_values_into_few_files(tmp_path: Path) -> None:
    """Thousands of values, a few files; each read back as put, also while its file fills."""
    store = TensorStore(tmp_path / "store")
    rng = np.random.default_rng(0)
    values = {f"t{i}": rng.standard_normal((i % 7, 3)).astype(np.float32) for i in range(3000)}
    values |= {"scalar": np.array(2.5), "flags": np.array([True, False]), "big": np.arange(9e6)}
    for name, value in values.items():
        store.put(name, value)
        assert np.array_equal(store.get(name), value)
    store.put("t5", np.ones(4, np.int64))  # a name stored again reads its new value
    values["t5"] = np.ones(4, np.int64)
    for name, value in values.items():
        got = store.get(name)
        assert got.dtype == value.dtype and got.shape == value.shape
        assert np.array_equal(got, value)
    # A file takes values until it passes PACK_BYTES: 3,002 values and the 72 MB "big" in the
    # first, the second "t5" in the next.
    assert len(list((tmp_path / "store").iterdir())) == 2


def test_stores_sharing_a_folder_keep_their_own_values(tmp_path: Path) -> None:
    """Two sessions over one scratch folder (the control-flow candidate beside the original,
    the quantized prelude done again after its early try) open stores of the same name: each
    reads back what it put, not the other's bytes at the same offset."""
    first, second = TensorStore(tmp_path / "reference"), TensorStore(tmp_path / "reference")
    first.put("x", np.full(16, 1.0, np.float32))
    second.put("x", np.full(16, 2.0, np.float32))
    second.put("y", np.arange(5, dtype=np.int64))
    assert np.array_equal(first.get("x"), np.full(16, 1.0, np.float32))
    assert np.array_equal(second.get("x"), np.full(16, 2.0, np.float32))
    assert np.array_equal(second.get("y"), np.arange(5, dtype=np.int64))


def test_torch_streams_every_probe_in_one_run() -> None:
    pytest.importorskip("torch")
    from onnx_bisect.backends.registry import create_backend
    from onnx_bisect.graph.extract import with_outputs

    loaded = load_model(chain(4, width=8))
    marked = with_outputs(loaded.model, list(loaded.probes))
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 8)).astype(np.float32)}
    backend = create_backend("torch:cpu?dtype=float64")
    assert backend.capabilities.streams
    got: dict[str, np.ndarray] = {}
    backend.stream(marked, feeds, got.__setitem__)  # type: ignore[attr-defined]
    assert list(got) == list(loaded.probes)  # in graph order, as each node finished
    whole = backend.run(marked, feeds)
    for name, value in whole.items():
        np.testing.assert_array_equal(got[name], value)


@pytest.mark.slow
def test_the_process_tree_stays_within_budget_weights_and_overhead(tmp_path: Path) -> None:
    """Measured, not planned: peak resident memory summed over the tree every 20 ms while the
    real CLI diagnoses 4x its budget of intermediates with an exec: runtime."""
    blocks, size, budget = 64, 64, 64 * MIB
    model = conv_net(blocks, size)
    path = tmp_path / "conv.onnx"
    onnx.save(model, path)
    assert intermediate_bytes(blocks, size) >= 4 * budget
    weights = sum(t.ByteSize() for t in model.graph.initializer)
    runtime = [sys.executable, str(FAULTY_RUNTIME), "{model}", "{inputs}", "{outputs}"]
    target = "exec:" + shlex.join([*runtime, "--fault", f"{FAULT}=0.05"])
    entry = "from onnx_bisect.entry import bisect_entry; bisect_entry()"
    argv = [sys.executable, "-c", entry, str(path), "--ref", "cpu", "--target", target,
            "--max-memory", "64MB", "--out", str(tmp_path / "out"), "--quiet"]  # fmt: skip
    peak = measure(argv, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=900)
    assert peak.returncode == 1
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["root_cause"]["nodes"] == [FAULT]
    assert peak.most_processes >= 2  # the exec: runtime's processes were in the sum
    assert peak.peak_tree <= budget + weights + FIXED_OVERHEAD, (
        f"peak {peak.peak_tree / MIB:.0f} MiB (main {peak.peak_main / MIB:.0f}, children "
        f"{peak.peak_children / MIB:.0f}) over {(budget + weights + FIXED_OVERHEAD) / MIB:.0f}"
    )
