"""The adapter registry: built-in adapters, entry-point plugins, plugins named by module or
file, and ``create_backend``, the one place a spec becomes a running backend."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from importlib import import_module
from importlib.metadata import entry_points

from onnx_bisect.backends.protocol import Backend, one_line
from onnx_bisect.backends.spec import ALIASES, BackendSpec, parse_spec
from onnx_bisect.errors import BackendUnavailableError, SpecError

__all__ = ["IN_PROCESS", "Adapter", "adapters", "check_known", "create_backend", "create_like"]

log = logging.getLogger(__name__)

# Adapters that stay in this process unless a child per run is asked for: onnx.reference is
# Python (it raises; it does not crash the interpreter), and a dump reads files.
IN_PROCESS = ("ref", "dump")


def _from_file(spec: BackendSpec) -> Callable[[BackendSpec], Backend]:
    """The class named by ``path/to/file.py:Class``, loaded from that file."""
    import importlib.util
    from pathlib import Path

    path, _, cls = (spec.device or "").rpartition(":")
    if not Path(path).is_file():
        raise BackendUnavailableError(f"backend {spec.text!r}: no such file {path}")
    module_spec = importlib.util.spec_from_file_location(
        f"onnx_bisect_plugin_{Path(path).stem}", path
    )
    if module_spec is None or module_spec.loader is None:
        raise BackendUnavailableError(f"backend {spec.text!r}: cannot import {path}")
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        raise BackendUnavailableError(
            f"backend {spec.text!r}: {path} failed to import: {one_line(exc)}"
        ) from exc
    factory = getattr(module, cls, None)
    if factory is None:
        raise BackendUnavailableError(f"backend {spec.text!r}: {path} has no {cls}")
    return factory  # type: ignore[no-any-return]


@dataclass(frozen=True)
class Adapter:
    """A registry entry. ``module:attr`` is imported only when used, so `onnx-bisect backends`
    does not import every runtime just to list them."""

    name: str
    target: str
    description: str
    loaded: Callable[[BackendSpec], Backend] | None = None

    def factory(self) -> Callable[[BackendSpec], Backend]:
        if self.loaded is not None:
            return self.loaded
        module, _, attr = self.target.partition(":")
        obj: Callable[[BackendSpec], Backend] = getattr(import_module(module), attr)
        return obj

    def availability(self) -> str | None:
        """None when usable here, else why not."""
        try:
            factory = self.factory()
        except Exception as exc:
            return f"cannot import {self.target}: {one_line(exc)}"
        check = getattr(factory, "unavailable_reason", None)
        return check() if callable(check) else None

    def details(self) -> str | None:
        """What a usable adapter has here (versions, devices), from its optional ``details``."""
        try:
            show = getattr(self.factory(), "details", None)
            return show() if callable(show) else None
        except Exception as exc:  # a listing must not fail because one plugin does
            return f"details unavailable: {one_line(exc)}"


_BUILTIN = (
    Adapter("ort", "onnx_bisect.backends.ort:OrtBackend", "ONNX Runtime (any execution provider)"),
    Adapter("ref", "onnx_bisect.backends.reference:ReferenceBackend", "onnx.reference evaluator"),
    Adapter("openvino", "onnx_bisect.backends.openvino:OpenVinoBackend", "OpenVINO runtime"),
    Adapter(
        "tract", "onnx_bisect.backends.tract:TractBackend", "tract (Sonos), via its Python bindings"
    ),
    Adapter("iree", "onnx_bisect.backends.iree:IreeBackend", "IREE: llvm-cpu, cuda, vulkan"),
    Adapter("tvm", "onnx_bisect.backends.tvm:TvmBackend", "Apache TVM: llvm, cuda"),
    Adapter("exec", "onnx_bisect.backends.exec:ExecBackend", "any program: exec:CMD protocol"),
    Adapter("dump", "onnx_bisect.backends.dump:DumpBackend", "tensors dumped earlier: dump:DIR"),
    Adapter("torch", "onnx_bisect.backends.torch:TorchBackend", "torch on cpu, cuda, mps or xpu"),
)


def adapters() -> dict[str, Adapter]:
    """Built-in adapters plus those from the ``onnx_bisect.adapters`` entry-point group."""
    found = {a.name: a for a in _BUILTIN}
    for ep in entry_points(group="onnx_bisect.adapters"):
        if ep.name in found:
            log.warning("plugin %s ignored: the name is taken by a built-in adapter", ep.value)
            continue
        found[ep.name] = Adapter(ep.name, ep.value, f"plugin from {ep.value}")
    return found


def create_backend(
    spec: str | BackendSpec, *, in_child: bool | None = False, timeout: float | None = None
) -> Backend:
    """Build a backend from a spec; unknown names and unusable backends raise clearly.

    ``in_child``: where an in-process runtime runs (``backends/worker.py``). False: in this
    process. None: in one long-lived child process that serves every run (a fresh one after a
    crash), so that a segfault, an abort or a panic is caught; the spec's own runtimes only
    (``ref``, onnx.reference in Python, and ``dump:`` stay here). True: in a fresh child
    process per run. ``timeout`` (seconds per run) turns a hang of a child into a crash.
    Backends that run a child already (``exec:``) take the timeout themselves.
    """
    parsed = parse_spec(spec) if isinstance(spec, str) else spec
    if parsed.transforms:
        # A backend runs whatever model it is given; bisect() applies the transforms.
        raise SpecError(
            f"backend {parsed.text!r}: model transforms (+{', +'.join(parsed.transforms)}) "
            "rewrite the model, not the runtime; pass the spec to bisect() or the CLI"
        )
    if parsed.name == "exec":
        from onnx_bisect.backends.exec import ExecBackend

        return ExecBackend(parsed, timeout)
    factory, parsed = _factory(parsed)
    backend = factory(parsed)  # validates the spec and availability here, not in a child
    if in_child or (in_child is None and parsed.name not in IN_PROCESS):
        from onnx_bisect.backends.worker import WorkerBackend

        return WorkerBackend(parsed, backend, timeout, fresh=bool(in_child))
    return backend


def create_like(spec: str | BackendSpec, like: Backend) -> Backend:
    """``spec`` built to run where ``like`` runs: a spec of the same runtime as a
    ``WorkerBackend`` runs in its children (the fp32 workaround of a target: contained as the
    target is, with no second start or import), anything else in this process."""
    parsed = parse_spec(spec) if isinstance(spec, str) else spec
    backend = create_backend(parsed)
    from onnx_bisect.backends.worker import WorkerBackend

    if isinstance(like, WorkerBackend) and parsed.name == like.spec.name:
        return like.sibling(backend.spec, backend)
    return backend


def _factory(parsed: BackendSpec) -> tuple[Callable[[BackendSpec], Backend], BackendSpec]:
    """The adapter's factory and the spec it is called with (a ``pkg.module:Class`` plugin
    gets its spec without the class in the device slot)."""
    if parsed.name == "file":
        return _from_file(parsed), parsed
    adapter, parsed = _adapter(parsed)
    try:
        return adapter.factory(), parsed
    except (ImportError, AttributeError) as exc:
        raise BackendUnavailableError(
            f"backend {parsed.text!r} is not available: {one_line(exc)}"
        ) from exc


def _adapter(parsed: BackendSpec) -> tuple[Adapter, BackendSpec]:
    table = adapters()
    adapter = table.get(parsed.name)
    if adapter is None and "." in parsed.name and parsed.device:
        # `pkg.module:Class`: a third-party adapter named by where it lives.
        adapter = Adapter(parsed.name, f"{parsed.name}:{parsed.device}", "plugin by module path")
        parsed = replace(parsed, device=None)
    if adapter is None:
        known = ", ".join(sorted(set(table) | set(ALIASES)))
        raise SpecError(f"unknown backend {parsed.name!r}; known: {known}")
    return adapter, parsed


def check_known(spec: str | BackendSpec) -> BackendSpec:
    """The spec parsed, its backend's name known (``SpecError`` otherwise), nothing imported
    or created: a sweep checks its targets so before any case runs."""
    parsed = parse_spec(spec) if isinstance(spec, str) else spec
    if parsed.name not in ("exec", "file"):
        _adapter(parsed)
    return parsed
