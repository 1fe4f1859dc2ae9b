"""What an operator implementation may ask of the interpreter: the device, the floating-point
policy, the opset, and a way to run a subgraph (``If``, ``Loop``, ``Scan``).

The policy is how ``dtype=float64`` (the oracle) and ``dtype=float16``/``bfloat16`` reach every
floating tensor the model makes, not only its inputs: constants, ``Cast`` targets,
``ConstantOfShape`` and random ops all ask ``floating()``. Integer and bool tensors are never
touched.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
import torch
from onnx import helper

from onnx_bisect.backends.torch.narrow import CARRIERS, carrier_from_numpy, numpy_from_carrier
from onnx_bisect.errors import BackendError
from onnx_bisect.graph.weights import tensor_array

__all__ = [
    "SUPPORTED_TYPES",
    "OpContext",
    "TensorSequence",
    "RunGraph",
    "cpu_channels_last",
    "attributes",
    "from_numpy",
    "onnx_to_torch_dtype",
    "to_numpy",
    "untraced",
]

# Runs a subgraph: its formal inputs bound in order, the caller's scope visible.
RunGraph = Callable[[onnx.GraphProto, Sequence["torch.Tensor | None"]], list["torch.Tensor | None"]]

_DTYPES: dict[int, torch.dtype] = {
    onnx.TensorProto.FLOAT: torch.float32,
    onnx.TensorProto.DOUBLE: torch.float64,
    onnx.TensorProto.FLOAT16: torch.float16,
    onnx.TensorProto.BFLOAT16: torch.bfloat16,
    onnx.TensorProto.INT8: torch.int8,
    onnx.TensorProto.INT16: torch.int16,
    onnx.TensorProto.INT32: torch.int32,
    onnx.TensorProto.INT64: torch.int64,
    onnx.TensorProto.UINT8: torch.uint8,
    onnx.TensorProto.UINT16: torch.uint16,
    onnx.TensorProto.UINT32: torch.uint32,
    onnx.TensorProto.UINT64: torch.uint64,
    onnx.TensorProto.BOOL: torch.bool,
    **CARRIERS,  # float8, float4, int4, int2: carried in a torch dtype (narrow.py)
}


SUPPORTED_TYPES = frozenset(_DTYPES)


def onnx_to_torch_dtype(elem_type: int) -> torch.dtype:
    try:
        return _DTYPES[elem_type]
    except KeyError:
        name = onnx.TensorProto.DataType.Name(elem_type)
        raise BackendError(f"the torch backend does not support tensors of type {name}") from None


@dataclass(frozen=True)
class OpContext:
    device: torch.device
    policy: torch.dtype | None  # every floating tensor is computed in this dtype; None: as written
    opset: int  # the model's opset for the node's domain
    run_graph: RunGraph
    num_outputs: int = 1  # how many outputs the node declares (Split without sizes needs it)
    # The ONNX element type of each input where the graph declares it (0: not declared): a
    # carrier (int8 for int4) does not tell QuantizeLinear which range its zero point has.
    input_types: tuple[int, ...] = ()

    def input_type(self, i: int) -> int:
        return self.input_types[i] if i < len(self.input_types) else 0

    def floating(self, dtype: torch.dtype) -> torch.dtype:
        """``dtype`` under the policy: floating types become the policy's, others stay."""
        return self.policy if self.policy is not None and dtype.is_floating_point else dtype

    def dtype(self, elem_type: int) -> torch.dtype:
        """The torch dtype for an ONNX element type, under the policy."""
        return self.floating(onnx_to_torch_dtype(elem_type))

    def tensor(self, value: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A tensor on the device from a number, a list or a numpy array, under the policy."""
        if isinstance(value, np.ndarray):
            out = from_numpy(value, self.device)
        else:
            out = torch.as_tensor(value, dtype=dtype, device=self.device)
        if dtype is not None:
            out = out.to(dtype)
        return out.to(self.floating(out.dtype))


@contextmanager
def untraced() -> Iterator[None]:
    """Tables an op computes from shapes alone (Resize's indices and weights) are constants:
    while ``compile=`` traces the model, they are computed outside the trace, so the op may
    read them. Outside a trace this does nothing."""
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    with disable_proxy_modes_tracing():
        yield


def from_numpy(array: npt.NDArray[Any], device: torch.device) -> torch.Tensor:
    if array.dtype == np.dtype("O") or array.dtype.kind in "SU":
        raise BackendError("the torch backend does not support string tensors")
    carried = carrier_from_numpy(array)
    if carried is not None:
        return carried.to(device)
    if "bfloat16" in str(array.dtype):  # ml_dtypes' bfloat16: torch reads it as raw bits
        bits = from_numpy(array.view(np.uint16), device)
        return bits.view(torch.bfloat16)
    # torch cannot wrap a read-only or non-native array; a copy is cheaper than a failure.
    # (ascontiguousarray makes a 0-d array 1-d: the reshape keeps scalars scalar.)
    array = np.ascontiguousarray(array).reshape(array.shape)
    if not array.flags.writeable:
        array = array.copy()
    return torch.from_numpy(array).to(device)


def cpu_channels_last(tensor: torch.Tensor) -> torch.Tensor:
    """A 4-D float32 CPU tensor in channels-last layout (others as they are): oneDNN's NHWC
    convolutions are about 3x faster than its NCHW ones (3x3 convs of YOLOv8n). Conv asks for
    it, the weight cache stores weights so once, and the layout flows on to the next Conv."""
    if tensor.dim() == 4 and tensor.device.type == "cpu" and tensor.dtype == torch.float32:
        return tensor.contiguous(memory_format=torch.channels_last)
    return tensor


class TensorSequence(list[torch.Tensor]):
    """An ONNX sequence value: its tensors in order. A distinct type, because an op that
    returns a plain list returns several outputs; an op producing a sequence returns
    ``[TensorSequence(...)]``. An empty optional is None, like an omitted input."""


def to_numpy(tensor: torch.Tensor) -> npt.NDArray[Any]:
    """A numpy copy; bfloat16, which numpy lacks, comes back as float32 (exact). A sequence
    comes back as a list of arrays."""
    if isinstance(tensor, TensorSequence):
        return [to_numpy(t) for t in tensor]
    t = tensor.detach()
    if t.dtype == torch.bfloat16:
        t = t.to(torch.float32)
    narrow = numpy_from_carrier(t)
    if narrow is not None:
        return narrow
    # Conv computes channels-last on CPU (ops/linear.py); callers get C-ordered arrays.
    array = t.cpu().numpy()
    return array if array.flags.c_contiguous else np.ascontiguousarray(array)  # keeps 0-d


def attributes(node: onnx.NodeProto) -> dict[str, Any]:
    """A node's attributes as Python values: strings decoded, tensors as numpy arrays,
    graphs as ``GraphProto``."""
    out: dict[str, Any] = {}
    for attr in node.attribute:
        value = helper.get_attribute_value(attr)
        if isinstance(value, bytes):
            value = value.decode()
        elif isinstance(value, onnx.TensorProto):
            value = tensor_array(value)
        elif isinstance(value, list) and value and isinstance(value[0], bytes):
            value = [v.decode() for v in value]
        out[attr.name] = value
    return out
