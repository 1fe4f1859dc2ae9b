"""Backend specs: ``NAME[:DEVICE][?key=value&...][+TRANSFORM...]``.

``exec:COMMAND`` and ``dump:PATH`` are taken verbatim; ``path/to/file.py:Class`` names a
plugin by file. Aliases such as ``cpu`` expand to ``ort:cpu``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from onnx_bisect.errors import SpecError
from onnx_bisect.transforms.registry import parse_transform

__all__ = ["ALIASES", "BackendSpec", "parse_spec"]


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
