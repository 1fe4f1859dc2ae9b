"""The float64 oracle: every probe in float64, and the fp32 noise of its twin, for noise floors.

torch computes it in its own process (``oracle/child.py``: its import then costs this process
nothing); ``onnx.reference`` in float64 is the fallback, in this process.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx

from onnx_bisect.backends.protocol import Backend, streams
from onnx_bisect.backends.registry import create_backend
from onnx_bisect.backends.torch.devices import find_spec_safe
from onnx_bisect.compare.noise import fp32_noise
from onnx_bisect.engine.measure.observe import probe_runs
from onnx_bisect.engine.measure.runs import plan_chunks, timed_run, timed_stream
from onnx_bisect.engine.measure.store import TensorStore
from onnx_bisect.engine.oracle import child as oracle_child
from onnx_bisect.engine.oracle.job import (
    ORACLE,
    TWIN,
    inexact,
    oracle_notes,
    precision_floors,
)
from onnx_bisect.engine.progress import Abandoned
from onnx_bisect.engine.session import Session
from onnx_bisect.errors import BackendError, BackendUnavailableError
from onnx_bisect.graph.extract import with_outputs
from onnx_bisect.graph.save import save_for_child
from onnx_bisect.graph.sizes import PROTO_LIMIT, model_bytes
from onnx_bisect.graph.view import TensorMeta
from onnx_bisect.inputs.feeds import save_npz
from onnx_bisect.text import plural

__all__ = ["FLOAT64_MAX_WEIGHTS", "FLOAT64_ORACLES", "Float64Run", "measure_float64"]

log = logging.getLogger(__name__)

# The float64 oracle, best first, each with its own fp32 twin (whose distance from float64 is
# the noise bound that tells a wrong reference from a noisy one): torch computes every op in
# float64 in a fraction of a second; onnx.reference is slower (BatchNormalization corrected
# in backends/reference.py).
FLOAT64_ORACLES = (
    (ORACLE, TWIN),
    ("ref?dtype=float64", "ref"),
)

# Above this many bytes of weights only the torch oracle runs: it reads each external weight
# when a node uses it (``backends/torch/interpreter.LAZY_EXTERNAL_BYTES``), where the reference
# evaluator would hold every weight in float64 and in its fp32 twin (3× the model), beside the
# reference and the target (1× each).
FLOAT64_MAX_WEIGHTS = PROTO_LIMIT

# Above this many bytes of weights held in the message the model is not written for the child:
# the oracle runs here instead (writing gigabytes would cost more than torch's import). External
# weights cost nothing: the child reads them from the user's files (``save_for_child``).
CHILD_MAX_WEIGHTS = 512 << 20


@dataclass(frozen=True)
class Float64Run:
    """The oracle's float64 value of every probe, and its fp32 twin's rel_l2 from them."""

    values: TensorStore
    oracle_noise: Mapping[str, float]
    # With a lower-precision target: per tensor, the faithful twin's accumulated error and
    # each node's isolated error at that precision, both against float64 (precision floors).
    precision_noise: Mapping[str, float] = field(default_factory=dict)
    precision_isolated: Mapping[str, float] = field(default_factory=dict)
    # Tensors whose value here is not a float64 one: a node only ONNX Runtime could compute,
    # in float32 (``backends/torch/stand_in.py``). No fp32 noise floor is measured for them.
    inexact: frozenset[str] = frozenset()


@dataclass(frozen=True)
class _Measured:
    run: Float64Run
    describe: str
    notes: tuple[str, ...]


def measure_float64(
    session: Session, names: Sequence[str] | None = None, *, in_child: bool = True
) -> Float64Run:
    """Every probe (or ``names``) computed in float64 by the first oracle that runs the model.

    ``in_child=False`` keeps torch in this process: a dataset's worker measures one input after
    another, and one import of torch costs less than a fresh child's per input."""
    weights = model_bytes(session.loaded.model).weights
    why_not: list[str] = []
    for spec, twin in FLOAT64_ORACLES:
        if session.cancelled.is_set():
            raise Abandoned(spec)
        if weights > FLOAT64_MAX_WEIGHTS and spec != ORACLE:
            # torch reads each external weight when a node uses it (LAZY_EXTERNAL_BYTES);
            # the reference evaluator would hold them all, upcast to float64.
            why_not.append(
                f"{spec}: not run on {weights / 1e9:.1f} GB of weights, which its float64 "
                "copy would double"
            )
            continue
        try:
            if spec == ORACLE and in_child and _child_can_run(session):
                measured = _in_child(session, names)
            else:
                measured = _here(session, spec, twin, names)
        except (BackendUnavailableError, BackendError) as exc:
            if session.cancelled.is_set():
                raise Abandoned(spec) from exc
            why_not.append(f"{spec}: {exc}")
            log.info("float64 oracle %s not used: %s", spec, exc)
            continue
        note = f"--threshold auto: float64 values from {measured.describe}"
        if why_not:
            note += f" ({'; '.join(why_not)})"
        session.notes.append(note)
        session.notes += measured.notes
        return measured.run
    raise BackendError("no float64 oracle could run the model: " + "; ".join(why_not))


def _here(session: Session, spec: str, twin: str, names: Sequence[str] | None = None) -> _Measured:
    backend, fp32 = create_backend(spec), create_backend(twin)
    run = _float64_probes(session, backend, fp32, _probes(session, names))
    run = replace(run, inexact=frozenset(inexact(backend)))
    return _Measured(run, backend.describe(), tuple(oracle_notes(backend, fp32)))


def _float64_probes(
    session: Session, backend: Backend, fp32: Backend, probes: Sequence[str]
) -> Float64Run:
    """Every probe in float64, then its fp32 twin, one run at a time: the float64 values go to
    the store before the twin runs. Oracles that stream (torch) compute every probe in one
    run each, holding one at a time; others run in chunks sized for float64."""
    s, loaded = session, session.loaded
    store = s.store("float64", factor=2)
    noise: dict[str, float] = {}

    def twin(name: str, single: npt.NDArray[Any]) -> None:
        measured = fp32_noise(store.get(name), single)
        if measured is not None:
            noise[name] = measured

    def keep(name: str, value: npt.NDArray[Any]) -> None:
        # An abandoned session's scratch folder is about to go: stop writing into it.
        if s.cancelled.is_set():
            raise Abandoned(backend.describe())
        store.put(name, value)

    if streams(backend) and streams(fp32):
        marked = with_outputs(loaded.model, probes)
        timed_stream(backend, marked, s.feeds, keep, "float64", s.stats)
        timed_stream(fp32, marked, s.feeds, twin, "float64", s.stats)
        precision = _floor_precision(s)
        if precision is None:
            return Float64Run(store, noise)
        floors = precision_floors(loaded.model, marked, s.feeds, store.get, precision)
        return Float64Run(store, noise, *floors)

    def use(chunk: list[str], marked: onnx.ModelProto) -> None:
        out = timed_run(backend, marked, s.feeds, "float64", s.stats)
        for name in chunk:
            keep(name, out[name])
        del out  # in the store: the twin's run gets its room
        out32 = timed_run(fp32, marked, s.feeds, "float64", s.stats)
        for name in chunk:
            if name in out32:
                twin(name, out32[name])

    probe_runs(loaded.model, probes, s.sizes, _chunk_bytes(s), use)
    log.debug("float64 reference: %s", plural(len(probes), "tensor"))
    return Float64Run(store, noise)


def _chunk_bytes(session: Session) -> int:
    """Probe bytes (at the model's dtypes) per oracle run that does not stream."""
    beside = session.memory.oracle_beside(session.options.parallel)
    return session.memory.chunk(factor=2, beside=beside)


def _child_can_run(session: Session) -> bool:
    if find_spec_safe("torch") is None:
        # The child would only die importing it; the oracle built here says what to install.
        return False
    inline = model_bytes(session.loaded.model).inline_data
    numeric = all(v.dtype.kind in "biufc" for v in session.feeds.values())
    return inline <= CHILD_MAX_WEIGHTS and numeric


def _probes(session: Session, names: Sequence[str] | None) -> list[str]:
    return list(session.loaded.probes if names is None else names)


def _in_child(session: Session, names: Sequence[str] | None = None) -> _Measured:
    """The torch oracle in its own process (prewarmed by the console script, if it was)."""
    s = session
    work = s.scratch / "float64-child"
    work.mkdir(parents=True, exist_ok=True)
    model_path = save_for_child(s.loaded.model, work)
    save_npz(work / "feeds.npz", s.feeds)
    job = {
        "model": str(model_path),
        "feeds": str(work / "feeds.npz"),
        "chunks": plan_chunks(_probes(s, names), s.sizes, _chunk_bytes(s)),
        "out": str(work / "values"),
        "precision": _floor_precision(s),
    }
    child = oracle_child.take_child()
    s.on_cancel(child.kill)  # the pipes are this thread's to close
    try:
        answer = child.compute(job)
    except ChildProcessError as exc:
        raise BackendError(str(exc)) from exc
    finally:
        child.close()
    if "error" in answer:
        error = BackendUnavailableError if answer["kind"] == "unavailable" else BackendError
        raise error(answer["error"])
    done = answer["ok"]
    for seconds in done["seconds"]:
        s.stats.record("float64", seconds)
    store = TensorStore(None)
    for name, (path, offset, dtype, shape) in done["files"].items():
        store.adopt(name, Path(path), TensorMeta(np.dtype(dtype), tuple(shape)), offset)
    run = Float64Run(
        store,
        done["noise"],
        done["precision_noise"],
        done["precision_isolated"],
        frozenset(done["inexact"]),
    )
    return _Measured(run, done["describe"], tuple(done["notes"]))


def _floor_precision(session: Session) -> str | None:
    """The precision whose floors the oracle measures: the target's, when it is lower."""
    target = session.setup.target_precision
    return target.precision.value if target.lowered else None
