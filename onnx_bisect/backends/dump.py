"""``dump:DIR``: tensors someone already dumped, for comparing two machines offline.

A dump is a directory of ``<sanitized tensor name>.npy`` files (what ``onnx-bisect dump``
writes), or one ``.npz`` keyed by tensor name, or ONNX test-case ``.pb`` TensorProtos carrying
their names. Sanitizing percent-encodes every byte outside ``[A-Za-z0-9._-]`` (``/`` becomes
``%2F``), so ``tensor_name()`` maps a file name back exactly.

A dump can only answer for the tensors it holds and cannot run anything else: there is no
isolation, window or cut search against it, only the accumulated comparison.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

import numpy.typing as npt
import onnx

from onnx_bisect.backends.protocol import BackendBase, Capabilities, Tensors
from onnx_bisect.backends.spec import BackendSpec
from onnx_bisect.errors import BackendError, InputError, SpecError
from onnx_bisect.graph.extract import derived_kind
from onnx_bisect.inputs.limits import ByteLimit
from onnx_bisect.inputs.npz import npz_headers, read_npy, read_npz, regular_file
from onnx_bisect.inputs.tensorpb import read_tensor_pb, tensor_pb_name

__all__ = ["DumpBackend", "INPUTS_FILE", "MANIFEST", "file_name", "tensor_name"]


INPUTS_FILE = "inputs.npz"


MANIFEST = "manifest.json"


_SAFE = "._-"
_WHAT = "dump"  # leads its errors: "dump DIR/x.pb: not a TensorProto (...)"


def file_name(tensor: str) -> str:
    """The file a tensor is dumped to: percent-encoded, so any name is a valid, unique file."""
    return quote(tensor, safe=_SAFE) + ".npy"


def tensor_name(file: str) -> str:
    """The tensor a dump file holds (the inverse of ``file_name``)."""
    return unquote(file.removesuffix(".npy"))


class DumpBackend(BackendBase):
    capabilities = Capabilities(computes=False, partial=True)

    def __init__(self, spec: BackendSpec) -> None:
        super().__init__(spec)
        spec.check_options([])
        self.path = Path(spec.device or "")
        if not spec.device or not self.path.exists():
            raise SpecError(f"backend {spec.text!r}: no dump at {self.path or '(empty path)'}")
        self._tensors = _index(self.path)
        if not self._tensors:
            raise SpecError(f"backend {spec.text!r}: {self.path} holds no .npy, .npz or .pb")

    def run(self, model: onnx.ModelProto, feeds: Mapping[str, npt.NDArray[Any]]) -> Tensors:
        if derived_kind(model) is not None:
            raise BackendError(f"{self.spec.text}: a dump cannot compute, only replay tensors")
        wanted = [o.name for o in model.graph.output]
        if wanted and not any(n in self._tensors for n in _tensor_names(model)):
            # Partial dumps are fine; one that holds nothing of this model is another's.
            names = sorted(self._tensors)
            held = ", ".join(names[:2]) + (", …" if len(names) > 2 else "")
            raise InputError(
                f"{self.spec.text} holds none of this model's tensors (it holds {held}): a "
                "dump of another model? dump this one with onnx-bisect dump MODEL --backend "
                "SPEC --out DIR"
            )
        return self.load([n for n in wanted if n in self._tensors])

    def load(self, names: Sequence[str]) -> Tensors:
        """The tensors ``names``, each checked against the machine from its header first; an
        .npz is read once for all the tensors it holds, its others never."""
        limit = ByteLimit.here(None)
        by_npz: dict[Path, set[str]] = {}
        for name in names:
            source = self._tensors[name]
            if source.suffix == ".npz":
                by_npz.setdefault(source.path, set()).add(source.key)
        arrays = {
            (path, key): value
            for path, keys in by_npz.items()
            for key, value in read_npz(path, keys, limit=limit, what=_WHAT).items()
        }
        out: dict[str, npt.NDArray[Any]] = {}
        for name in names:
            source = self._tensors[name]
            if source.suffix == ".npz":
                out[name] = arrays[source.path, source.key]
            elif source.suffix == ".pb":
                out[name] = read_tensor_pb(source.path, limit=limit, what=_WHAT)[1]
            else:
                out[name] = read_npy(source.path, limit=limit, what=_WHAT)
        return out

    def recorded_inputs(self) -> Tensors | None:
        """The inputs recorded with the dump, when it has them."""
        path = self.path / INPUTS_FILE if self.path.is_dir() else None
        if path is None or not path.is_file():
            return None
        return read_npz(path, what=_WHAT)

    def describe(self) -> str:
        manifest = self.path / MANIFEST if self.path.is_dir() else None
        if manifest is not None and manifest.is_file():
            try:
                backend = json.loads(manifest.read_bytes())["backend"]
            except (ValueError, KeyError, TypeError):
                backend = None  # not ours, or damaged: it only names the backend
            if isinstance(backend, str):
                return f"dump of {backend} ({len(self._tensors)} tensors)"
        return f"dump at {self.path} ({len(self._tensors)} tensors)"


def _tensor_names(model: onnx.ModelProto) -> set[str]:
    graph = model.graph
    return {o for n in graph.node for o in n.output} | {o.name for o in graph.output}


@dataclass(frozen=True)
class _Source:
    """Where a dumped tensor is: a file, or array ``key`` of an .npz (read when asked for:
    a dump's headers are checked when it is opened, its data only as each tensor is needed)."""

    path: Path
    key: str = ""

    @property
    def suffix(self) -> str:
        return self.path.suffix


def _index(path: Path) -> dict[str, _Source]:
    """Tensor name -> where its value is. Every file is checked as it is indexed: a regular
    file, a TensorProto that parses, an .npz whose headers hold no pickled objects."""
    if path.is_file() and path.suffix == ".npz":
        return {k: _Source(path, k) for k in npz_headers(path, what=_WHAT)}
    found: dict[str, _Source] = {}
    for f in sorted(path.glob("*.npy")):
        regular_file(f, _WHAT)
        found[tensor_name(f.name)] = _Source(f)
    limit = ByteLimit.here(None)
    for f in sorted(path.glob("*.pb")):
        name = tensor_pb_name(f, limit=limit, what=_WHAT)
        if name:
            found[name] = _Source(f)
    npz = sorted(p for p in path.glob("*.npz") if p.name != INPUTS_FILE)
    for z_path in npz:
        found.update({k: _Source(z_path, k) for k in npz_headers(z_path, what=_WHAT)})
    return found
