"""The PyTorch side: the factory loaded and called, the module put in eval mode, and run on
the ONNX model's inputs with a forward hook on every named submodule capturing its output
(and a pre-hook its tensor inputs). torch is imported here, when the mode is used."""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from onnx_bisect.errors import InputError

__all__ = [
    "PREFIX",
    "Captured",
    "TorchModel",
    "call_args",
    "capture",
    "float_dtype",
    "is_torch_ref",
    "load_torch_ref",
    "precision_twin",
]

PREFIX = "pytorch:"
Array = npt.NDArray[Any]


@dataclass(frozen=True)
class TorchModel:
    """The module to run, where it came from (``model.py:make`` or its class) and whether it
    was in training mode before it was put in eval mode."""

    module: Any  # torch.nn.Module; Any so that this module's types need no torch import
    source: str
    was_training: bool
    example: tuple[Array, ...] = ()  # the factory's example inputs, as numpy


@dataclass
class Captured:
    """What one forward pass gave: each module's output (the last call's, where a module runs
    more than once), its tensor inputs, its class, and the top module's outputs in order."""

    outputs: dict[str, Array] = field(default_factory=dict)
    inputs: dict[str, list[Array]] = field(default_factory=dict)
    classes: dict[str, str] = field(default_factory=dict)
    final: list[Array] = field(default_factory=list)
    modules: int = 0  # named submodules hooked (the top module not counted)


def is_torch_ref(ref: object) -> bool:
    """Whether ``ref`` asks for PyTorch as the reference: an ``nn.Module`` or a
    ``pytorch:FILE.py:FACTORY`` spec."""
    if isinstance(ref, str):
        return ref.startswith(PREFIX)
    nn = _torch_nn_if_loaded()
    return nn is not None and isinstance(ref, nn.Module)


def _torch_nn_if_loaded() -> Any:
    import sys

    torch = sys.modules.get("torch")  # an nn.Module exists only if torch is imported already
    return getattr(torch, "nn", None) if torch is not None else None


def load_torch_ref(ref: object, role: str = "ref") -> TorchModel:
    """The module ``ref`` names, in eval mode. ``pytorch:FILE.py:FACTORY``: ``FACTORY()`` in
    ``FILE.py`` returns an ``nn.Module`` or ``(module, example_inputs)``. ``role``: the option
    that named it (``ref`` or ``target``), for errors."""
    import torch

    source = type(ref).__name__
    made: Any = ref
    if isinstance(ref, str):
        path, _, name = ref.removeprefix(PREFIX).rpartition(":")
        if not path or not name:
            raise InputError(f"{role} {ref}: expected pytorch:FILE.py:FACTORY", option=role)
        made = getattr(_import_file(Path(path), ref, role), name, None)
        if made is None:
            raise InputError(f"{role} {ref}: {path} has no {name}", option=role)
        made = made()
        source = f"{Path(path).name}:{name}"
    module = made[0] if isinstance(made, tuple | list) else made
    if not isinstance(module, torch.nn.Module):
        raise InputError(
            f"{role}: {source} gave {type(module).__name__}, not an nn.Module", option=role
        )
    example = _tensors(made[1]) if isinstance(made, tuple | list) and len(made) > 1 else []
    was_training = bool(module.training)
    module.eval()
    return TorchModel(module, source, was_training, tuple(example))


def precision_twin(model: TorchModel) -> TorchModel:
    """A deep copy of the module in the other float precision: float64 for a float32 module
    (its float64 run gives each output's fp32 noise, as the float64 oracle does for two
    backends), float32 for a float64 one (the precision an ONNX model in float32 computes
    in). The module itself is left as it is."""
    import copy

    import torch

    twin = copy.deepcopy(model.module)
    twin = twin.float() if float_dtype(model.module) == torch.float64 else twin.double()
    return TorchModel(twin.eval(), model.source, model.was_training, model.example)


def float_dtype(module: Any) -> Any:
    """The dtype the module computes floats in: its first float parameter's or buffer's
    (float32 for a module with none)."""
    import torch

    tensors = [*module.parameters(), *module.buffers()]
    return next((t.dtype for t in tensors if t.is_floating_point()), torch.float32)


def _import_file(path: Path, ref: str, role: str) -> Any:
    if not path.is_file():
        raise InputError(f"{role} {ref}: no such file {path}", option=role)
    spec = importlib.util.spec_from_file_location(f"onnx_bisect_ref_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise InputError(f"{role} {ref}: cannot import {path}", option=role)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def capture(
    model: TorchModel,
    feeds: Mapping[str, Array],
    onnx_inputs: Sequence[str],
    layouts: Mapping[str, tuple[int, ...]] | None = None,
) -> Captured:
    """One forward pass on ``feeds``, every named submodule's output and inputs captured;
    ``layouts``: the axis order that puts an ONNX input in the module's layout."""
    import torch

    got = Captured()
    handles = []
    for name, sub in model.module.named_modules():
        if not name:
            continue
        got.classes[name] = type(sub).__name__
        handles.append(sub.register_forward_pre_hook(_pre_hook(name, got), with_kwargs=True))
        handles.append(sub.register_forward_hook(_hook(name, got)))
    got.modules = len(got.classes)
    args, kwargs = call_args(model, feeds, onnx_inputs, layouts or {})
    try:
        with torch.no_grad():
            out = model.module(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    got.final.extend(_tensors(out))
    if got.final:
        # The top module too (not counted as hooked): a divergence in its own forward's ops,
        # outside every submodule, has its nodes to blame.
        got.outputs[""] = got.final[0]
        got.inputs[""] = _tensors((args, kwargs))
    return got


def call_args(
    model: TorchModel,
    feeds: Mapping[str, Array],
    names: Sequence[str],
    layouts: Mapping[str, tuple[int, ...]],
) -> tuple[list[Any], dict[str, Any]]:
    """ONNX input names <-> ``forward``'s parameter names where they all match, else by
    position (a TorchScript export names its inputs ``input.1``). Float inputs in the float
    dtype the module computes in (a float64 module is fed the float32 inputs as float64),
    an input whose example is of another kind in the example's dtype, and transposed into
    the module's layout where ``layouts`` says."""
    import torch

    module = model.module
    dtype = float_dtype(module)
    kinds = dict(zip(names, model.example, strict=False))
    tensors = {}
    for n in names:
        value = np.asarray(feeds[n])
        if n in layouts:
            value = value.transpose(layouts[n])
        example = kinds.get(n)
        if example is not None and example.dtype.kind != value.dtype.kind:
            value = value.astype(example.dtype)
        t = torch.from_numpy(np.ascontiguousarray(value))
        tensors[n] = t.to(dtype) if t.is_floating_point() else t
    params = inspect.signature(module.forward).parameters
    if all(n in params for n in names):
        return [], tensors
    return [tensors[n] for n in names], {}


def _pre_hook(name: str, got: Captured) -> Any:
    def hook(_mod: Any, args: Any, kwargs: Any) -> None:
        got.inputs[name] = _tensors((args, kwargs))

    return hook


def _hook(name: str, got: Captured) -> Any:
    def hook(_mod: Any, _args: Any, out: Any) -> None:
        found = _tensors(out)
        if found:  # a module's output is its first tensor (an LSTM's is its sequence)
            got.outputs[name] = found[0]

    return hook


def _tensors(value: Any) -> list[Array]:
    """Every tensor in ``value`` (nested tuples, lists and dicts), in order, as numpy."""
    import torch

    if isinstance(value, torch.Tensor):
        return [value.detach().cpu().numpy().copy()]
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, tuple | list):
        return [t for v in value for t in _tensors(v)]
    return []
