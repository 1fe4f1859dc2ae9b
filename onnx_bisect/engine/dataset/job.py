"""The per-input work of a dataset run: screen one input, or scan and isolate one.

Both are module-level functions of a picklable ``DatasetJob`` (the model, the backend specs,
the options, the inputs' paths) and an input's index, so ``parallel.run_tasks`` can run
them in worker processes or as Ray tasks. Backends cannot be pickled: each worker prepares
the setup once (``worker_cached``) and opens a session per input over it, as a single-input
diagnosis does. What comes back is small: comparisons of the final outputs, a few floats per
node.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import onnx

from onnx_bisect.backends.spec import BackendSpec, parse_spec
from onnx_bisect.compare.topk import topk_checks
from onnx_bisect.dataset_result import InputScreen
from onnx_bisect.engine.control_flow import with_control_flow_inlined
from onnx_bisect.engine.dataset.parallel import worker_cached
from onnx_bisect.engine.dataset.stats import MeasuredInput, NodeSample
from onnx_bisect.engine.diagnose import BackendLike, diagnose, open_session, prepare, screen_session
from onnx_bisect.engine.session import Feeds, Session, Setup, StageTimer, scratch_dir
from onnx_bisect.errors import BackendError, InputError
from onnx_bisect.graph.load import load_model
from onnx_bisect.inputs.dataset import DatasetItem, check_dataset, find_dataset, load_item
from onnx_bisect.inputs.signature import InputSpec, input_specs
from onnx_bisect.options import BisectOptions, ModelLike

__all__ = ["DatasetJob", "dataset_job", "measure_input", "screen_input"]


@dataclass(frozen=True)
class DatasetJob:
    """What every worker needs, sent once per worker: no backend, no tensor."""

    model: str | onnx.ModelProto
    ref: BackendLike
    target: BackendLike
    options: BisectOptions  # per input: no dataset, inputs given, scan and isolate all
    items: tuple[DatasetItem, ...]
    specs: tuple[InputSpec, ...]
    key: str  # this job's setup in a worker's cache

    def feeds(self, index: int) -> Feeds:
        opts = self.options
        return load_item(
            self.items[index],
            self.specs,
            max_memory=opts.max_memory,
            allow_nonfinite=opts.allow_nonfinite,
        )

    def label(self, index: int) -> str:
        return self.items[index].label


def dataset_job(
    model: ModelLike, ref: BackendLike, target: BackendLike, options: BisectOptions
) -> DatasetJob:
    """The job of ``options.dataset``: its inputs found and every one checked against the
    model (names, dtypes, shapes alike) before anything runs."""
    assert options.dataset is not None
    parallel = "ray" if options.ray is not None else "jobs" if options.jobs > 1 else None
    if parallel and not all(isinstance(b, str | BackendSpec) for b in (ref, target)):
        raise InputError(
            f"{parallel}: workers build their own backends, so ref and target must be specs "
            "(strings), not Backend objects; run those with jobs=1",
            option=parallel,
        )
    for role, backend in (("ref", ref), ("target", target)):
        _check_computes(role, backend)
    items = find_dataset(options.dataset)
    proto = model if isinstance(model, onnx.ModelProto) else _signature(Path(model))
    specs = tuple(input_specs(proto))
    check_dataset(
        items, specs, max_memory=options.max_memory, allow_nonfinite=options.allow_nonfinite
    )
    per_input = dataclasses.replace(
        options,
        dataset=None,
        sample=None,
        jobs=1,
        ray=None,
        # Every sampled input is scanned and isolated whole: a cut search names one node, and
        # the statistics need them all.
        strategy="scan",
        always_scan=True,
        repro=None,
        bisect_passes="off",
    )
    source = model if isinstance(model, onnx.ModelProto) else str(model)
    return DatasetJob(source, ref, target, per_input, items, specs, uuid.uuid4().hex)


def screen_input(job: DatasetJob, index: int) -> InputScreen:
    """Plain runs of both backends on one input; the final outputs compared, with noise floors
    of the outputs alone under ``--threshold auto``."""
    setup = _setup(job)
    feeds = job.feeds(index)
    with scratch_dir() as scratch, ExitStack() as opened:
        finals = setup.loaded.outputs
        session = _open(setup, feeds, scratch, StageTimer(), noise_for=finals)
        opened.callback(session.abandon)  # before the scratch folder goes
        screened = screen_session(session)
        runs = dict(session.stats.runs)
        crit = session.crit
    if isinstance(screened, BackendError):
        line = str(screened).splitlines()[0] if str(screened) else type(screened).__name__
        return InputScreen(index, job.label(index), (), True, None, float("inf"), line, runs=runs)
    outputs = tuple(screened.comparisons.values())
    worst = max(outputs, key=crit.badness)
    checks = topk_checks(list(setup.topk), screened.ref_outputs, screened.target_outputs)
    return InputScreen(
        index=index,
        label=job.label(index),
        outputs=outputs,
        diverged=screened.diverged,
        error=worst.score,
        badness=crit.badness(worst),
        task_checks=tuple(checks),
        runs=runs,
    )


def measure_input(job: DatasetJob, index: int) -> MeasuredInput:
    """One input diagnosed with the scan strategy, kept to each node's accumulated and
    isolated numbers."""
    setup = _setup(job)
    feeds = job.feeds(index)
    timer = StageTimer()
    with scratch_dir() as scratch, ExitStack() as opened:

        def begin(chosen: Setup) -> Session:
            session = _open(chosen, feeds, scratch, timer)
            opened.callback(session.abandon)  # before the scratch folder goes
            return session

        session, screened = with_control_flow_inlined(begin(setup), begin)
        diagnosis = diagnose(session, screened)
    nodes = diagnosis.found.nodes if diagnosis.found is not None else ()
    return MeasuredInput(
        index=index,
        label=job.label(index),
        diverged=diagnosis.diverged,
        nodes=tuple(NodeSample.of(n) for n in nodes),
        runs=dict(session.stats.runs),
    )


def _open(
    setup: Setup,
    feeds: Feeds,
    scratch: Path,
    timer: StageTimer,
    noise_for: Sequence[str] | None = None,
) -> Session:
    """A session for one input. A worker opens one after another, so torch (the float64
    oracle) is imported once in the worker, not once per input in a child of its own."""
    return open_session(setup, feeds, scratch, timer, noise_for=noise_for, oracle_in_child=False)


def _setup(job: DatasetJob) -> Setup:
    """This worker's setup of ``job``, prepared once (on the dataset's first input)."""
    return worker_cached(job.key, lambda: _prepare(job))


def _prepare(job: DatasetJob) -> Setup:
    options = dataclasses.replace(job.options, inputs=job.feeds(0))
    setup, _ = prepare(job.model, job.ref, job.target, options, StageTimer())
    return setup


def _check_computes(role: str, backend: BackendLike) -> None:
    """A dump answers for the one input it was made with, so it cannot take a dataset."""
    if isinstance(backend, str | BackendSpec):
        spec = parse_spec(backend) if isinstance(backend, str) else backend
        replays = spec.name == "dump"
    else:
        spec = backend.spec
        replays = backend.recorded_inputs() is not None or not backend.capabilities.computes
    if replays:
        raise InputError(
            f"dataset: the {role} {spec.text} replays tensors recorded for one input; a dataset "
            "needs backends that compute",
            option="dataset",
        )


def _signature(path: Path) -> onnx.ModelProto:
    """The graph's declarations only (weights stay on disk): enough for ``input_specs``."""
    try:
        return onnx.load(str(path), load_external_data=False)
    except Exception:
        return load_model(path).model  # raises the ModelLoadError that says what is wrong
