"""Writing a model: for a runtime (weights shared beside it), for this package's own child
process (weights left where they are) or to keep (weights copied)."""

from __future__ import annotations

import glob
from pathlib import Path

import onnx

from onnx_bisect.graph.sizes import model_bytes
from onnx_bisect.graph.weights import place_weights

__all__ = ["save_for_child", "save_model", "save_portable"]


def save_model(model: onnx.ModelProto, directory: Path, name: str = "model.onnx") -> Path:
    """Write a model for a runtime to read once: its external weight files shared beside it
    (``place_weights``: a run costs no copy of the weights, and the user's file gets no second
    link), inline weights too large for one message moved to a file of their own."""
    return _save(model, directory, name, link=True)


def save_for_child(model: onnx.ModelProto, directory: Path, name: str = "model.onnx") -> Path:
    """Write a model for this package's own child process, which reads it with
    ``read_model(path, own=True)``: external tensors keep their absolute locations (nothing
    linked or copied; runtimes in the child get the weights as in this process), inline weights
    too large for one message moved to a file of their own."""
    return _save(model, directory, name, link=None)


def save_portable(model: onnx.ModelProto, directory: Path, name: str = "model.onnx") -> Path:
    """Write a model that stands alone (a repro bundle): the bytes of the external tensors it
    uses copied into ``<name>.data``, so that it travels without the original weight file;
    inline weights too large for one message go there too."""
    return _save(model, directory, name, link=False)


def _save(model: onnx.ModelProto, directory: Path, name: str, *, link: bool | None) -> Path:
    """``link``: True shares the weight files beside the model, False copies the bytes used,
    None leaves external locations as they are (absolute, once loaded)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    # A model written again in the same place (a bundle's next candidate) leaves no weight file
    # of the last one behind, and onnx, which appends to its data file, starts afresh.
    for old in directory.glob(f"{glob.escape(name)}*.data"):
        old.unlink()
    placed = model if link is None else place_weights(model, directory, name, link=link)
    large = not model_bytes(placed).fits
    # onnx appends to the file it is given: beside a shared weight file (a clone or a link)
    # that must be a file of its own; a portable model's copied weights may take the rest.
    spill = directory / (f"{name}.data" if link is False else f"{name}.inline.data")
    if large and placed is model:
        # onnx.save_model moves weights out of the message it is given; keep the caller's.
        placed = onnx.ModelProto()
        placed.CopyFrom(model)
    onnx.save_model(
        placed,
        str(path),
        save_as_external_data=large,
        all_tensors_to_one_file=True,
        location=spill.name,
    )
    return path
