"""``ref``: the ONNX reference evaluator, slow but written from the spec.

``ref?dtype=float64`` runs an upcast copy of the model (``precision.upcast_model``) on float64
feeds and returns float64 outputs: a reference that rounds far less than the runtimes it judges.
``dtype=float32``, the default, runs the model as written. Operators that ``onnx.reference``
computes wrongly run our corrections (``reference_ops``) instead.

numpy's floating-point warnings (``overflow encountered in exp``) become notes, counted, instead
of RuntimeWarnings on stderr: an overflow is often the very divergence being searched for.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx

from onnx_bisect.backends.protocol import BackendBase, Tensors
from onnx_bisect.backends.spec import BackendSpec
from onnx_bisect.errors import SpecError
from onnx_bisect.graph.weights import with_loaded_weights

__all__ = ["DTYPES", "ReferenceBackend"]


DTYPES = ("float32", "float64")


class _FloatErrors:
    """numpy's ``errstate(call=...)`` log target: "Warning: overflow encountered in exp\n"."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def write(self, message: str) -> None:
        self.counts[message.removeprefix("Warning: ").strip()] += 1


class ReferenceBackend(BackendBase):
    def __init__(self, spec: BackendSpec) -> None:
        super().__init__(spec)
        spec.check_options(["dtype"])
        dtype = spec.option("dtype", "float32")
        if dtype not in DTYPES:
            raise SpecError(
                f"backend {spec.text!r}: dtype={dtype!r} is not supported; use dtype=float32 "
                "(the model as written, the default) or dtype=float64 (an upcast copy)"
            )
        self.dtype = dtype

    def _run(self, model: onnx.ModelProto, feeds: Mapping[str, npt.NDArray[Any]]) -> Tensors:
        from onnx.reference import ReferenceEvaluator

        from onnx_bisect.backends.reference_ops import NEW_OPS

        # The evaluator reads initializers from the message: external weights are loaded here.
        model = with_loaded_weights(model)
        if self.dtype == "float64":
            from onnx_bisect.transforms.upcast import upcast_feeds, upcast_model

            model, feeds = upcast_model(model), upcast_feeds(feeds)
        errors = _FloatErrors()
        # "log" instead of warnings.catch_warnings: errstate is local to this thread's context,
        # while catch_warnings swaps process-wide state under the other backend's thread.
        # numpy's defaults otherwise (underflow stays ignored: it is rounding, not an error).
        with np.errstate(divide="log", over="log", invalid="log", call=errors):
            evaluator = ReferenceEvaluator(model, new_ops=NEW_OPS)
            names = [o.name for o in model.graph.output]
            wanted = set(evaluator.input_names)
            values = evaluator.run(names, {k: v for k, v in feeds.items() if k in wanted})
        for text, n in errors.counts.items():
            self._note(f"{self.spec.text}: {text}", n)
        return dict(zip(names, values, strict=True))

    def describe(self) -> str:
        from onnx_bisect.backends.reference_ops import CORRECTIONS

        fixed = "; ".join(CORRECTIONS)
        return (
            f"onnx.reference.ReferenceEvaluator (onnx {onnx.__version__}, {self.dtype}; "
            f"corrected: {fixed})"
        )

    def versions(self) -> dict[str, str]:
        return {"onnx": onnx.__version__}
