"""A sweep's cases as Ray tasks (``engine/dataset/ray_tasks.run_on_ray``), on a cluster at an
address or one started here (``local``).

No shared file system is assumed: the models and their inputs travel to the workers in Ray's
object store (put once, fetched once per worker process), each case runs ``bisect`` in a
child process in a temporary folder of its worker, and the files it wrote travel back in the
task's result, written into the sweep's folder by the driver as each case finishes.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from onnx_bisect.backends.registry import check_known
from onnx_bisect.cases.child import run_case
from onnx_bisect.cases.plan import Case, CaseOptions
from onnx_bisect.engine.dataset.ray_tasks import run_on_ray
from onnx_bisect.engine.dataset.worker import thread_env
from onnx_bisect.sweep_result import CaseResult

__all__ = ["Shipment", "run_on_cluster"]

Files = Mapping[str, bytes]  # relative path -> bytes


@dataclass(frozen=True)
class Shipment:
    """What every task shares: the options, the sweep's folder (for the commands shown) and
    each model's files (the model, its external weights, its inputs) by model name."""

    options: CaseOptions
    out: str
    files: Mapping[str, Files]
    threads: Mapping[str, str]


def run_on_cluster(
    cases: Sequence[Case],
    options: CaseOptions,
    out: Path,
    *,
    address: str,
    jobs: int,
    finished: Callable[[CaseResult], None],
) -> None:
    if not cases:
        return
    models = {c.model.name: c for c in cases}
    shipment = Shipment(
        options=options,
        out=str(out),
        files={name: _pack_model(case) for name, case in models.items()},
        threads=thread_env(jobs),
    )

    def done(index: int, packed: tuple[CaseResult, Files]) -> None:
        result, files = packed
        _unpack(out / cases[index].folder, files, replace=True)
        finished(result)

    run_on_ray(
        _remote_case,
        shipment,
        list(cases),
        jobs=jobs,
        address=address,
        done=done,
        resources=partial(_resources, options=options),
    )


# Devices a case's task must be placed with a GPU for (a spec's device, lowercased).
_GPU_DEVICES = ("cuda", "tensorrt", "trt", "rocm", "gpu", "dml")
# What a case costs beyond its --max-memory budget (FIXED_OVERHEAD measured at most 600 MB).
_OVERHEAD_BYTES = 600 << 20


def _resources(case: Case, *, options: CaseOptions) -> dict[str, float]:
    """Ray's resources for a case: a GPU where its target runs on one; with ``max_memory``,
    the budget and the overhead, so that a node is not given more cases than it can hold."""
    wanted: dict[str, float] = {}
    device = (check_known(case.target.spec).device or "").lower()
    if device.split(":")[0] in _GPU_DEVICES:
        wanted["num_gpus"] = 1
    if options.max_memory is not None:
        wanted["memory"] = options.max_memory + _OVERHEAD_BYTES
    return wanted


def _remote_case(shipment: Shipment, case: Case) -> tuple[CaseResult, Files]:
    """In a Ray worker: the case's files written to a temporary folder, the case run there, and
    what it wrote read back."""
    with tempfile.TemporaryDirectory(prefix="onnx-bisect-ray-case-") as scratch:
        root = Path(scratch)
        _unpack(root, shipment.files[case.model.name])
        model = root / "model" / case.model.path.name
        given = case.model.inputs
        inputs = root / "inputs" / given.name if given is not None else None
        folder = root / "out"
        result = run_case(
            case,
            shipment.options,
            Path(shipment.out),
            folder=folder,
            env=shipment.threads,
            model=model,
            inputs=inputs,
        )
        return result, _pack(folder, "")


def _pack_model(case: Case) -> dict[str, bytes]:
    files = {f"model/{case.model.path.name}": case.model.path.read_bytes()}
    for location in _external_locations(case.model.path):
        source = case.model.path.parent / location
        if source.is_file():
            files[f"model/{location}"] = source.read_bytes()
    given = case.model.inputs
    if given is not None:
        if given.is_dir():
            files.update(_pack(given, f"inputs/{given.name}/"))
        else:
            files[f"inputs/{given.name}"] = given.read_bytes()
    return files


def _external_locations(path: Path) -> list[str]:
    """The files a model's external weights are in, relative to its folder."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    found: dict[str, None] = {}
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                found[entry.value] = None
    return list(found)


def _pack(folder: Path, prefix: str) -> dict[str, bytes]:
    """Every regular file under ``folder`` (links and staging leftovers are not followed)."""
    return {
        prefix + p.relative_to(folder).as_posix(): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def _unpack(folder: Path, files: Files, *, replace: bool = False) -> None:
    """``files`` into ``folder``; with ``replace``, what an earlier run of the case left there
    removed first."""
    if replace and folder.is_dir():
        shutil.rmtree(folder)
    for name, data in files.items():
        path = folder / name
        if ".." in Path(name).parts or Path(name).is_absolute():
            continue  # never outside the folder, whatever a worker sent
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
