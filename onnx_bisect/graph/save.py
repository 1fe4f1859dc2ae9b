"""Writing a model for a runtime, with external data when one file cannot hold it."""

from __future__ import annotations

from pathlib import Path

import onnx

from onnx_bisect.graph.sizes import PROTO_LIMIT

__all__ = ["save_model"]


def save_model(model: onnx.ModelProto, directory: Path, name: str = "model.onnx") -> Path:
    """Write a model for a runtime; weights go to ``<name>.data`` when one file can't hold it."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    large = model.ByteSize() >= PROTO_LIMIT
    if large:
        # save_model moves the weights out of the message it is given; keep the caller's intact.
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        model = copy
    onnx.save_model(
        model,
        str(path),
        save_as_external_data=large,
        all_tensors_to_one_file=True,
        location=f"{name}.data",
    )
    return path
