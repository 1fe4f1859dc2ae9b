"""``tract``: Sonos' tract inference engine, through its Python bindings (``pip install tract``).

tract types every tensor before it runs a model, and it takes the shapes written in the file
as facts to unify with its own inference. Two things in common exports defeat that (both
measured on YOLOv8n): symbolic input dims (``batch``, ``height``) that it must later unify with
concrete ones, and ``value_info`` entries whose dims (``floor(height/2 - 1/2) + 1`` and the
like) it cannot reconcile with what it derives. So the adapter loads a copy of the model with
``graph.value_info`` cleared and sets each input's fact to the dtype and shape of the array
fed to it; tract infers everything else. The bindings return outputs by position (named after
their producing nodes), which the adapter maps back to the graph outputs' tensor names.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from importlib import import_module
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx

from onnx_bisect.backends.protocol import BackendBase, Tensors
from onnx_bisect.backends.spec import BackendSpec
from onnx_bisect.backends.static_view import StaticType
from onnx_bisect.errors import BackendUnavailableError, SpecError
from onnx_bisect.graph.save import save_model

__all__ = ["TractBackend", "input_fact", "parse_fact", "without_value_info"]


def without_value_info(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` with ``graph.value_info`` cleared; ``model`` is left untouched."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.value_info[:]
    return out


def input_fact(array: npt.NDArray[Any]) -> str:
    """tract's fact for an input fed with ``array``: its shape and element type, "1,3,8,8,f32"."""
    dtype = np.dtype(array.dtype)
    if dtype.kind == "b":
        kind = "bool"
    elif dtype.kind in "iuf":
        kind = f"{dtype.kind}{dtype.itemsize * 8}"
    else:
        raise RuntimeError(f"tract takes no {dtype} input")
    return ",".join([*(str(int(n)) for n in array.shape), kind])


class TractBackend(BackendBase):
    def __init__(self, spec: BackendSpec) -> None:
        super().__init__(spec)
        spec.check_options([])
        if spec.device is not None:
            raise SpecError(f"backend {spec.text!r}: tract takes no device; write 'tract'")
        reason = self.unavailable_reason()
        if reason:
            raise BackendUnavailableError(f"backend {spec.text!r} is not available: {reason}")

    @staticmethod
    def unavailable_reason() -> str | None:
        try:
            _tract()
        except ImportError:
            return "the tract package is not installed (pip install 'onnx-bisect[tract]')"
        except Exception as exc:  # the bindings load a native library at import
            return f"the tract package does not load: {' '.join(str(exc).split())[:200]}"
        return None

    def _run(self, model: onnx.ModelProto, feeds: Mapping[str, npt.NDArray[Any]]) -> Tensors:
        try:
            return self._tract_run(model, feeds)
        except Exception as exc:
            if type(exc).__name__ != "TractError":
                raise
            # tract's messages carry a Rust stack backtrace: keep the part before it
            # (BackendBase then makes it a one-line BackendError).
            text = " ".join(str(exc).split("Stack backtrace:", 1)[0].split())
            raise RuntimeError(text or "TractError") from exc

    def _tract_run(self, model: onnx.ModelProto, feeds: Mapping[str, npt.NDArray[Any]]) -> Tensors:
        tract = _tract()
        names = [o.name for o in model.graph.output]
        with tempfile.TemporaryDirectory(prefix="onnx-bisect-tract-") as tmp:
            inference, fed = _inference(tract, model, feeds, Path(tmp))
            runnable = inference.into_model().into_runnable()
        count = runnable.output_count()
        if count != len(names):
            raise RuntimeError(f"tract has {count} output(s), the model {len(names)}")
        # As they are: tract copies them, and keeps 0-d arrays scalars (ascontiguousarray won't).
        results = runnable.run(fed)
        # Outputs come back by position, named after their nodes: map them to tensor names.
        return {name: _to_numpy(tract, r) for name, r in zip(names, results, strict=True)}

    def static_types(
        self, model: onnx.ModelProto, feeds: Mapping[str, npt.NDArray[Any]]
    ) -> dict[str, StaticType] | None:
        """Each graph output as tract's analysis types it, the inputs typed from ``feeds`` as a
        run types them (by position, as ``_tract_run`` maps outputs)."""

        def analysed() -> dict[str, StaticType]:
            names = [o.name for o in model.graph.output]
            with tempfile.TemporaryDirectory(prefix="onnx-bisect-tract-") as tmp:
                inference, _ = _inference(_tract(), model, feeds, Path(tmp))
                inference.analyse()
                facts = [str(inference.output_fact(i)) for i in range(inference.output_count())]
            return {n: parse_fact(f) for n, f in zip(names, facts, strict=False)}

        return self._wrapped(analysed)

    def describe(self) -> str:
        return f"tract {_version()} (CPU)"

    def versions(self) -> dict[str, str]:
        return {"tract": _version()}


def _inference(
    tract: Any, model: onnx.ModelProto, feeds: Mapping[str, npt.NDArray[Any]], tmp: Path
) -> tuple[Any, list[npt.NDArray[Any]]]:
    """tract's inference model of ``model`` with each input's fact set from the array fed to
    it, and those arrays in tract's order of inputs."""
    initializers = {t.name for t in model.graph.initializer}
    fed = {
        i.name: feeds[i.name]
        for i in model.graph.input
        if i.name not in initializers and i.name in feeds
    }
    # The bindings load from a path only (no bytes API), so the copy goes through a file.
    inference = tract.onnx().load(str(save_model(without_value_info(model), tmp)))
    # tract's own list of inputs, in its order, each typed from its array.
    order = [inference.input_name(i) for i in range(inference.input_count())]
    missing = [n for n in order if n not in fed]
    if missing:
        raise RuntimeError(f"no value for input(s) {', '.join(missing)}")
    for i, name in enumerate(order):
        inference.set_input_fact(i, input_fact(fed[name]))
    return inference, [np.asarray(fed[n]) for n in order]


# tract's element types by their names in a fact ("1,4,f32"); TDim is its shape arithmetic,
# int64 in ONNX.
_FACT_TYPES = {
    **{f"{k}{b}": np.dtype(f"{k}{b // 8}") for k in "iu" for b in (8, 16, 32, 64)},
    **{f"f{b}": np.dtype(f"f{b // 8}") for b in (16, 32, 64)},
    "bool": np.dtype(bool),
    "TDim": np.dtype(np.int64),
}


def parse_fact(fact: str) -> StaticType:
    """tract's fact ("1,?,f32"; "..,?" where neither rank nor type is known) as a
    ``StaticType``: ".." among the dimensions is an unknown rank, "?" an unknown size or type,
    a symbol (``N``) an unknown size."""
    *dims, kind = fact.split(",")
    shape = None
    if ".." not in dims:
        shape = tuple(int(d) if d.isdigit() else None for d in dims)
    return StaticType(_FACT_TYPES.get(kind), shape, fact)


def _tract() -> Any:
    # Imported by name: the bindings ship no type information.
    return import_module("tract")


def _version() -> str:
    try:
        return version("tract")
    except PackageNotFoundError:
        return "unknown"


def _to_numpy(tract: Any, tensor: Any) -> npt.NDArray[Any]:
    try:
        return np.asarray(tensor.to_numpy())
    except Exception as exc:
        # Shape arithmetic (Shape, Gather on a shape) is typed TDim inside tract, a type the
        # bindings cannot export; ONNX says int64.
        if "TDim" not in str(exc):
            raise
        return np.asarray(tensor.convert_to(tract.DatumType.I64).to_numpy())
