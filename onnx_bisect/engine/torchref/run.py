"""The PyTorch-side diagnosis: the module captured, its outputs mapped to ONNX tensors, those
compared with the ONNX model's run (PyTorch the reference and the ONNX model on the target,
or the roles swapped), the first divergent module's root cause and its repro bundle, and a
``BisectResult`` whose first divergence and root cause name the ONNX nodes and whose sources
name the module."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import numpy.typing as npt

from onnx_bisect.backends.protocol import Backend
from onnx_bisect.backends.registry import create_backend
from onnx_bisect.backends.spec import BackendSpec, parse_spec
from onnx_bisect.compare.criterion import Comparison, Criterion
from onnx_bisect.compare.tensors import compare_tensors
from onnx_bisect.engine.recorded import option_feeds
from onnx_bisect.engine.session import StageTimer
from onnx_bisect.engine.torchref.assemble import Sides, torch_notes, torch_result
from onnx_bisect.engine.torchref.capture import (
    Captured,
    TorchModel,
    call_args,
    capture,
    float_dtype,
    is_torch_ref,
    load_torch_ref,
    precision_twin,
)
from onnx_bisect.engine.torchref.cause import (
    Cause,
    Side,
    Window,
    module_cause,
    module_window,
    training_ops,
)
from onnx_bisect.engine.torchref.faults import (
    Changed,
    Preprocessing,
    changed_weights,
    preprocessing,
)
from onnx_bisect.engine.torchref.fx import FxValues, Narrowed, capture_fx, fx_groups, narrow
from onnx_bisect.engine.torchref.mapping import (
    Mapped,
    candidates,
    map_modules,
    module_paths,
    scope_nodes,
)
from onnx_bisect.engine.torchref.noise import noise_criterion, noise_floors, precision_note
from onnx_bisect.errors import InputError
from onnx_bisect.graph.extract import with_outputs
from onnx_bisect.graph.load import load_model
from onnx_bisect.graph.view import LoadedModel, NodeInfo
from onnx_bisect.graph.weights import tensor_array
from onnx_bisect.options import BisectOptions, ModelLike
from onnx_bisect.result import BisectResult, CauseKind, ReproInfo
from onnx_bisect.torch_result import ModuleRecord, TorchRefSummary

__all__ = ["BundleRequest", "Bundler", "bisect_torch"]

Array = npt.NDArray[Any]
# The causes a bundle shows: the module's ONNX nodes, fed its inputs, off from its output.
BUNDLED = (CauseKind.EXPORT, CauseKind.RUNTIME, CauseKind.REFERENCE)


@dataclass(frozen=True)
class BundleRequest:
    """What a repro bundle of a PyTorch-side run is cut from: the root cause's window (the
    module's ONNX nodes and its captured inputs), the module's output there (what the bundle
    expects), the backend that ran the ONNX model and whether a fresh process can rebuild it
    from ``spec``, the criterion, and the module's description."""

    window: Window
    tensor: str
    expected: Array
    backend: Backend
    spec: str | None  # None: given as an object, the bundle is checked in this process
    crit: Criterion
    label: str
    source: str  # pytorch:FILE.py:FACTORY, for repro.py's title
    nodes_before: int


Bundler = Callable[[BundleRequest], ReproInfo]


def bisect_torch(
    model: ModelLike,
    ref: object,
    target: Any,
    opts: BisectOptions,
    timer: StageTimer,
    bundler: Bundler | None = None,
) -> BisectResult:
    """The ONNX model against a PyTorch module (an ``nn.Module`` or
    ``pytorch:FILE.py:FACTORY``) module by module: the module is ``ref`` (the ONNX model on
    ``target`` under test) or ``target`` (the module under test against the ONNX model on
    ``ref``). ``bundler`` writes the repro bundle where ``opts.repro`` asks for one."""
    torch_is_ref = is_torch_ref(ref)
    _refuse(opts, torch_is_ref, target)
    given, torch_given = (target, ref) if torch_is_ref else (ref, target)
    with timer.stage("load"):
        loaded = load_model(model)
        role = "target" if torch_is_ref else "ref"
        backend = (
            _backend(given, role) if isinstance(given, str | BackendSpec) else cast(Backend, given)
        )
        sides = Sides(torch_is_ref, backend, given)
        feeds = option_feeds(loaded.model, (backend,), opts)
        torch_model = load_torch_ref(torch_given, "ref" if torch_is_ref else "target")
    module64 = _module64(torch_model, loaded)
    pre = preprocessing(loaded.inputs, feeds, torch_model.example)
    with timer.stage("torch"):
        got = _capture(torch_model, feeds, loaded.inputs, pre)
        twin = None
        if opts.auto_threshold or module64:
            twin = _capture(precision_twin(torch_model), feeds, loaded.inputs, pre)
    paths = module_paths(loaded)
    stale = _stale(loaded, torch_model, paths)
    found = candidates(loaded, paths, list(got.outputs))
    marked = list(dict.fromkeys([*loaded.outputs, *(t for ts in found.values() for t in ts)]))
    with timer.stage(sides.onnx_role):
        values = backend.run(with_outputs(loaded.model, marked), feeds)
    mapped = map_modules(loaded, found, got.outputs, values)
    floors = noise_floors(got, twin, mapped, loaded.outputs) if twin is not None else {}
    crit = noise_criterion(opts, floors) if opts.auto_threshold else opts.criterion()
    records = _records(mapped, got, values, crit, sides)
    outputs = tuple(
        compare_tensors(name, *sides.pair(_f32(ref_out), _f32(values.get(name))), crit)
        for name, ref_out in zip(loaded.outputs, got.final, strict=False)
    )
    first = next((r for r in records if r.comparison.diverged), None)
    cause, repro, ops = None, None, None
    said: list[str] = []
    if first is not None:
        with timer.stage("root cause"):
            side = _side(torch_is_ref, got, twin if module64 else None, first.module)
            side = dataclasses.replace(side, captured={c.initializer: c.said for c in stale})
            job = _Job(loaded, paths, torch_model, got, pre, feeds, values, sides, crit)
            found_cause = _cause(job, first, side)
            cause, ops = _at_inputs(found_cause.cause, pre), found_cause.ops
            if found_cause.note:
                said.append(found_cause.note)
        if opts.repro is not None and bundler is not None and cause.root.kind in BUNDLED:
            with timer.stage("repro"):
                repro = bundler(_request(cause, first, got, sides, crit, torch_model, loaded))
    summary = TorchRefSummary(
        source=torch_model.source,
        modules=got.modules,
        mapped=tuple(records),
        unmapped=tuple(m for m in got.classes if m not in {r.module for r in records}),
        first_module=first.module if first is not None else None,
        was_training=torch_model.was_training,
        role="reference" if torch_is_ref else "target",
        preprocessing=pre.said,
        **_ops(ops, loaded),
    )
    said = [*pre.said, *precision_note(opts.auto_threshold, module64, floors), *said]
    if stale:
        said.append(
            f"initializers captured at export time that differ from the module's parameters "
            f"or buffers at run time ({len(stale)}): "
            f"{'; '.join(f'{c.initializer} ({c.said})' for c in stale[:5])}"
        )
    if opts.repro is not None and repro is None and cause is not None:
        said.append("no repro bundle: no export, runtime or reference fault to show")
    notes = torch_notes(summary, cause, training_ops(loaded), said)
    return torch_result(loaded, sides, summary, outputs, (cause, repro), feeds, timer, opts, notes)


def _capture(
    model: TorchModel, feeds: Mapping[str, Array], names: Sequence[str], pre: Preprocessing
) -> Captured:
    """The module's forward pass; its failure is the user's (a module that cannot take the
    ONNX model's inputs), said with what the inputs disagree on."""
    try:
        return capture(model, feeds, names, pre.layouts)
    except Exception as exc:  # the user's module: any error it raises
        said = "; ".join(pre.said)
        raise InputError(
            f"pytorch:{model.source} failed on the ONNX model's inputs: "
            f"{type(exc).__name__}: {exc}" + (f" ({said})" if said else "")
        ) from exc


def _stale(loaded: LoadedModel, model: TorchModel, paths: Mapping[str, str]) -> list[Changed]:
    """Initializers standing for the module's parameters and buffers whose values differ."""
    state = {k: v.detach().cpu().numpy() for k, v in model.module.state_dict().items()}
    readers = loaded.readers
    owners = {
        t.name: {paths[n.name] for n in readers.get(t.name, ()) if n.name in paths}
        for t in loaded.model.graph.initializer
    }
    inits = {
        t.name: tensor_array(t)
        for t in loaded.model.graph.initializer
        if t.name in state or len(owners[t.name]) == 1
    }
    return changed_weights(inits, state, owners)


def _at_inputs(cause: Cause, pre: Preprocessing) -> Cause:
    """No fault in the module's own nodes, where the ONNX inputs and the module's forward
    inputs disagree: the difference comes from the inputs (``preprocessing``)."""
    if cause.root.kind is not CauseKind.NONE or not pre.said:
        return cause
    said = "; ".join(s.removeprefix("preprocessing: ") for s in pre.said)
    reason = (
        f"{cause.root.reason.partition(':')[0]}: fed the module's own inputs, its ONNX nodes "
        f"agree with torch; the ONNX model's inputs differ from the module's: {said}"
    )
    root = dataclasses.replace(cause.root, kind=CauseKind.PREPROCESSING, reason=reason)
    return dataclasses.replace(cause, root=root)


def _refuse(opts: BisectOptions, torch_is_ref: bool, target: Any) -> None:
    """What the mode does not take (yet): both sides PyTorch, other modes' options."""
    if torch_is_ref and is_torch_ref(target):
        raise InputError(
            "target: both ref and target are PyTorch modules; one must run the ONNX model",
            option="target",
        )
    other = [f"--{k}" for k in ("dataset", "steps", "target_model") if getattr(opts, k)]
    if other:
        flags = ", ".join(o.replace("_", "-") for o in other)
        raise InputError(f"ref pytorch: cannot be combined with {flags} yet", option="ref")


def _backend(given: str | BackendSpec, role: str) -> Backend:
    spec = parse_spec(given) if isinstance(given, str) else given
    if spec.transforms:
        raise InputError(
            f"{role} {spec.text}: +transforms are not taken with a PyTorch side yet",
            option=role,
        )
    return create_backend(spec)


def _module64(model: TorchModel, loaded: LoadedModel) -> bool:
    """A module computing in float64 against an ONNX model whose float inputs are float32."""
    import torch

    dtypes = [loaded.dtypes.get(n) for n in loaded.inputs]
    return float_dtype(model.module) == torch.float64 and np.dtype(np.float32) in dtypes


def _f32(value: Array | None) -> Array | None:
    """Compared in float32: torch's float64 against the export's float32 is no divergence
    by itself."""
    if value is None:
        return None
    v = np.asarray(value)
    return v.astype(np.float32) if v.dtype.kind == "f" else v


def _records(
    mapped: Sequence[Mapped],
    got: Captured,
    values: Mapping[str, Array],
    crit: Criterion,
    sides: Sides,
) -> list[ModuleRecord]:
    return [
        ModuleRecord(
            module=m.module,
            class_name=got.classes.get(m.module, ""),
            tensor=m.tensor,
            node=m.node.name,
            op_type=m.node.op_type,
            index=m.node.index,
            comparison=_compare(m.tensor, got.outputs[m.module], values[m.tensor], crit, sides),
        )
        for m in mapped
    ]


def _compare(
    tensor: str, torch_value: Array, onnx_value: Array, crit: Criterion, sides: Sides
) -> Comparison:
    return compare_tensors(tensor, *sides.pair(_f32(torch_value), _f32(onnx_value)), crit)


def _side(torch_is_ref: bool, got: Captured, twin32: Captured | None, module: str) -> Side:
    """Where torch stands, with a float64 module's output and its float32 twin's."""
    if twin32 is None:
        return Side(torch_is_ref)
    return Side(torch_is_ref, got.outputs.get(module), twin32.outputs.get(module))


@dataclass(frozen=True)
class _Job:
    """What the root cause's search reads: the model and its module paths, the module's
    capture, the ONNX model's feeds and first run's values, the sides, the criterion."""

    loaded: LoadedModel
    paths: Mapping[str, str]
    torch_model: TorchModel
    got: Captured
    pre: Preprocessing
    feeds: Mapping[str, Array]
    values: Mapping[str, Array]
    sides: Sides
    crit: Criterion


@dataclass(frozen=True)
class _Found:
    cause: Cause
    ops: Narrowed | None = None
    note: str = ""


def _cause(job: _Job, first: ModuleRecord, side: Side) -> _Found:
    """The first divergent module's ONNX nodes fed its own captured inputs (tensors they read
    from elsewhere are the ONNX backend's: the first run's, else one more run). Where the
    module holds several torch ops (a dynamo export's metadata says so), the first divergent
    op's nodes, fed that op's own inputs (``fx.narrow``)."""
    loaded, feeds, values, backend = job.loaded, job.feeds, job.values, job.sides.backend
    fetched: list[str] = []

    def fetch(names: Sequence[str]) -> Mapping[str, Array]:
        rest = [n for n in names if n not in values]
        fetched.extend(rest)
        more = backend.run(with_outputs(loaded.model, rest), feeds) if rest else {}
        return {**{n: values[n] for n in names if n in values}, **more}

    scope = scope_nodes(loaded, job.paths, first.module)
    groups = fx_groups(loaded, scope)
    ops, note = _narrow(job, groups, fetch) if len(groups) > 1 else (None, "")
    if ops is not None and ops[1].first is not None:
        fx, op = ops[0], ops[1].first
        mine = [fx.values[i] for i in fx.inputs.get(op.op, []) if i in fx.values]
        window = module_window(loaded, op.nodes, op.tensor, mine, feeds, fetch)
        label = f"{_label(first)}, op {op.op} ({op.target})"
        side = dataclasses.replace(side, torch64=None, twin32=None)
        cause = module_cause(window, op.tensor, fx.values[op.op], backend, job.crit, label, side)
    else:
        inputs = job.got.inputs.get(first.module, [])
        window = module_window(loaded, scope, first.tensor, inputs, feeds, fetch)
        output = job.got.outputs[first.module]
        cause = module_cause(window, first.tensor, output, backend, job.crit, _label(first), side)
    cause = dataclasses.replace(cause, target_runs=cause.target_runs + bool(fetched))
    return _Found(cause, ops[1] if ops is not None else None, note)


def _narrow(
    job: _Job,
    groups: Mapping[str, list[NodeInfo]],
    fetch: Callable[[Sequence[str]], Mapping[str, Array]],
) -> tuple[tuple[FxValues, Narrowed] | None, str]:
    """The module's ops by ``torch.export`` and an FX interpreter, each compared; None and
    why where the module does not export."""
    args, kwargs = call_args(job.torch_model, job.feeds, job.loaded.inputs, job.pre.layouts)
    try:
        fx = capture_fx(job.torch_model.module, args, kwargs)
    except Exception as exc:  # torch.export refuses many a module: the module level stands
        return None, f"torch.export failed ({type(exc).__name__}); the module's nodes stand"
    sides, crit = job.sides, job.crit

    def compare(tensor: str, torch_value: Array, onnx_value: Array) -> Comparison:
        return _compare(tensor, torch_value, onnx_value, crit, sides)

    return (fx, narrow(groups, fx, fetch, compare)), ""


def _ops(ops: Narrowed | None, loaded: LoadedModel) -> dict[str, Any]:
    """TorchRefSummary's fields of the ops inside the first divergent module."""
    if ops is None:
        return {}
    records = tuple(
        ModuleRecord(
            module=o.op,
            class_name=o.target,
            tensor=o.tensor,
            node=loaded.producer[o.tensor].name,
            op_type=loaded.producer[o.tensor].op_type,
            index=loaded.producer[o.tensor].index,
            comparison=o.comparison,
        )
        for o in ops.mapped
    )
    first = ops.first.op if ops.first is not None else None
    return {"ops": records, "ops_unmapped": ops.unmapped, "first_op": first}


def _label(first: ModuleRecord) -> str:
    cls = f" ({first.class_name})" if first.class_name else ""
    return f"module {first.module or '(top)'}{cls}"


def _request(
    cause: Cause,
    first: ModuleRecord,
    got: Captured,
    sides: Sides,
    crit: Criterion,
    torch_model: TorchModel,
    loaded: LoadedModel,
) -> BundleRequest:
    assert cause.window is not None  # module_cause always keeps it
    given = sides.given
    spec = given if isinstance(given, str) else None
    if isinstance(given, BackendSpec):
        spec = given.text
    return BundleRequest(
        window=cause.window,
        tensor=cause.tensor or first.tensor,
        expected=cause.expected if cause.expected is not None else got.outputs[first.module],
        backend=sides.backend,
        spec=spec,
        crit=crit,
        label=cause.root.reason.partition(": ")[0],
        source=f"pytorch:{torch_model.source}",
        nodes_before=len(loaded.nodes),
    )
