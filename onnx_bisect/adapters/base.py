"""The Backend protocol, backend-spec parsing and the adapter registry.

Spec grammar: ``NAME[:DEVICE][?key=value&...][+TRANSFORM...]``, except ``exec:COMMAND``, whose
command is taken verbatim. Aliases such as ``cpu`` expand to ``ort:cpu``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from importlib import import_module
from importlib.metadata import entry_points
from types import MappingProxyType
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt
import onnx

from onnx_bisect.errors import BackendError, BackendUnavailableError, OnnxBisectError, SpecError
from onnx_bisect.transforms import parse_transform

__all__ = [
    "ALIASES",
    "Adapter",
    "Backend",
    "BackendBase",
    "BackendSpec",
    "Tensors",
    "adapters",
    "create_backend",
    "parse_spec",
]

log = logging.getLogger(__name__)

Tensors = dict[str, npt.NDArray[Any]]

# Short names for the common cases: `cpu` is what people type, `ort:cpu` is what it means.
ALIASES: Mapping[str, tuple[str, str]] = MappingProxyType(
    {
        "cpu": ("ort", "cpu"),
        "cuda": ("ort", "cuda"),
        "tensorrt": ("ort", "tensorrt"),
        "trt": ("ort", "tensorrt"),
        "coreml": ("ort", "coreml"),
        "dml": ("ort", "dml"),
        "rocm": ("ort", "rocm"),
        "onnxruntime": ("ort", "cpu"),
        "mps": ("torch", "mps"),
    }
)


@dataclass(frozen=True)
class BackendSpec:
    """A parsed backend spec; ``text`` is what the user wrote, for reports."""

    text: str
    name: str
    device: str | None = None
    options: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    transforms: tuple[str, ...] = ()

    def option(self, key: str, default: str | None = None) -> str | None:
        return self.options.get(key, default)

    def without_transforms(self) -> BackendSpec:
        """The runtime part alone: transforms rewrite the model, not the backend."""
        if not self.transforms:
            return self
        return replace(self, text=self.text.split("+", 1)[0].strip(), transforms=())

    def check_options(self, allowed: Sequence[str]) -> None:
        unknown = sorted(set(self.options) - set(allowed))
        if unknown:
            valid = ", ".join(allowed) or "none"
            raise SpecError(
                f"backend {self.text!r}: unknown option(s) {', '.join(unknown)}; valid: {valid}"
            )


_SPEC = re.compile(r"^(?P<name>[A-Za-z_][\w.-]*)(?::(?P<device>[^?+]*))?(?:\?(?P<query>[^+]*))?$")


def parse_spec(text: str) -> BackendSpec:
    """Parse ``NAME[:DEVICE][?k=v&...][+T...]``; raises SpecError with the expected form."""
    raw = text.strip()
    if not raw:
        raise SpecError("empty backend spec; try 'cpu', 'ref' or 'openvino'")
    for verbatim in ("exec", "dump"):
        # A command line or a path: taken as written, '?' and '+' included.
        if raw.startswith(f"{verbatim}:"):
            return BackendSpec(text=raw, name=verbatim, device=raw[len(verbatim) + 1 :].strip())
    file_plugin = _FILE_SPEC.match(raw)
    if file_plugin:
        # `path/to/file.py:Class?k=v`: the path may hold any character but '?'.
        options = _options(text, file_plugin["query"] or "")
        return BackendSpec(
            text=raw, name="file", device=f"{file_plugin['path']}:{file_plugin['cls']}",
            options=MappingProxyType(options),
        )  # fmt: skip
    head, *transforms = raw.split("+")
    m = _SPEC.match(head)
    if not m:
        raise SpecError(
            f"cannot parse backend spec {text!r}; expected NAME[:DEVICE][?key=value&...]"
        )
    name, device = m["name"].lower(), m["device"] or None
    if name in ALIASES:
        if device is not None:
            raise SpecError(f"backend {text!r}: alias {name!r} already names a device")
        name, device = ALIASES[name]
    options = _options(text, m["query"] or "")
    for t in transforms:
        if t.strip():
            parse_transform(t)  # an unknown transform is a usage error, caught before any run
    return BackendSpec(
        text=raw,
        name=name,
        # A dotted name is a module path whose device part is a class name: keep its case.
        device=device.lower() if device and "." not in name else device,
        options=MappingProxyType(options),
        transforms=tuple(t.strip() for t in transforms if t.strip()),
    )


_FILE_SPEC = re.compile(r"^(?P<path>[^?]+\.py):(?P<cls>[A-Za-z_]\w*)(?:\?(?P<query>.*))?$")


def _options(text: str, query: str) -> dict[str, str]:
    options: dict[str, str] = {}
    for part in filter(None, query.split("&")):
        key, sep, value = part.partition("=")
        if not sep or not key:
            raise SpecError(f"backend {text!r}: option {part!r} must look like key=value")
        options[key.strip()] = value.strip()
    return options


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
            f"backend {spec.text!r}: {path} failed to import: {_one_line(exc)}"
        ) from exc
    factory = getattr(module, cls, None)
    if factory is None:
        raise BackendUnavailableError(f"backend {spec.text!r}: {path} has no {cls}")
    return factory  # type: ignore[no-any-return]


@runtime_checkable
class Backend(Protocol):
    """What the search needs from a runtime. Implement it without inheriting if you like.

    ``run`` executes ``model`` (whose graph outputs are the tensors wanted) on ``feeds`` and
    returns every graph output by name. Raise ``BackendError`` when the runtime fails.
    """

    spec: BackendSpec

    def run(self, model: onnx.ModelProto, feeds: Mapping[str, npt.NDArray[Any]]) -> Tensors: ...

    def describe(self) -> str: ...

    def versions(self) -> dict[str, str]: ...


class BackendBase:
    """Validation and error wrapping around ``_run``, so adapters stay small."""

    spec: BackendSpec

    def __init__(self, spec: BackendSpec) -> None:
        self.spec = spec

    def run(self, model: onnx.ModelProto, feeds: Mapping[str, npt.NDArray[Any]]) -> Tensors:
        wanted = [o.name for o in model.graph.output]
        try:
            out = self._run(model, feeds)
        except OnnxBisectError:
            raise
        except Exception as exc:
            # Runtimes raise their own types; the message is what the user needs.
            raise BackendError(f"{self.spec.text}: {_one_line(exc)}") from exc
        missing = [n for n in wanted if n not in out]
        if missing:
            raise BackendError(
                f"{self.spec.text}: did not return output(s) {', '.join(missing[:5])}"
                + (" ..." if len(missing) > 5 else "")
            )
        return {n: np.asarray(out[n]) for n in wanted}

    def _run(self, model: onnx.ModelProto, feeds: Mapping[str, npt.NDArray[Any]]) -> Tensors:
        raise NotImplementedError

    def describe(self) -> str:
        return self.spec.text

    def versions(self) -> dict[str, str]:
        return {}


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:400]


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
            return f"cannot import {self.target}: {_one_line(exc)}"
        check = getattr(factory, "unavailable_reason", None)
        return check() if callable(check) else None


_BUILTIN = (
    Adapter("ort", "onnx_bisect.adapters.ort:OrtBackend", "ONNX Runtime (any execution provider)"),
    Adapter("ref", "onnx_bisect.adapters.reference:ReferenceBackend", "onnx.reference evaluator"),
    Adapter("openvino", "onnx_bisect.adapters.openvino:OpenVinoBackend", "OpenVINO runtime"),
    Adapter(
        "tract", "onnx_bisect.adapters.tract:TractBackend", "tract (Sonos), via its Python bindings"
    ),
    Adapter("exec", "onnx_bisect.adapters.exec:ExecBackend", "any program: exec:CMD protocol"),
    Adapter("dump", "onnx_bisect.adapters.dump:DumpBackend", "tensors dumped earlier: dump:DIR"),
    Adapter("torch", "onnx_bisect.adapters.unavailable:TorchBackend", "torch (mps/cuda/cpu)"),
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


def create_backend(spec: str | BackendSpec) -> Backend:
    """Build a backend from a spec; unknown names and unusable backends raise clearly."""
    parsed = parse_spec(spec) if isinstance(spec, str) else spec
    if parsed.transforms:
        # A backend runs whatever model it is given; bisect() applies the transforms.
        raise SpecError(
            f"backend {parsed.text!r}: model transforms (+{', +'.join(parsed.transforms)}) "
            "rewrite the model, not the runtime; pass the spec to bisect() or the CLI"
        )
    if parsed.name == "file":
        return _from_file(parsed)(parsed)
    table = adapters()
    adapter = table.get(parsed.name)
    if adapter is None and "." in parsed.name and parsed.device:
        # `pkg.module:Class`: a third-party adapter named by where it lives.
        adapter = Adapter(parsed.name, f"{parsed.name}:{parsed.device}", "plugin by module path")
        parsed = replace(parsed, device=None)
    if adapter is None:
        known = ", ".join(sorted(set(table) | set(ALIASES)))
        raise SpecError(f"unknown backend {parsed.name!r}; known: {known}")
    try:
        factory = adapter.factory()
    except (ImportError, AttributeError) as exc:
        raise BackendUnavailableError(
            f"backend {parsed.text!r} is not available: {_one_line(exc)}"
        ) from exc
    return factory(parsed)
