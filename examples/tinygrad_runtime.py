#!/usr/bin/env python3
"""tinygrad as an exec: runtime: the recipe of docs/backends.md ("tinygrad, through exec:").

    bisect MODEL --target \
        "exec:env DEV=CPU {python} examples/tinygrad_runtime.py {model} {inputs} {outputs}"

It runs MODEL with tinygrad's own ONNX runner (``tinygrad.nn.onnx.OnnxRunner``) on INPUTS (.npz
keyed by input name) and writes every graph output to OUTPUTS (.npz keyed by output name), as
the exec: protocol asks (docs/exec-protocol.md). It needs numpy and tinygrad (measured with
0.14.0); settings for tinygrad go in the command as ``env NAME=VALUE``, so that the report and
the repro bundle carry them: ``DEV=CPU`` (clang), ``DEV=CPU:LLVM`` (libLLVM), ``DEV=PYTHON``.
``DEFAULT_FLOAT=HALF`` (tinygrad's own setting for its default float, which its ONNX runner
does not apply to a model's float32 tensors) runs the model in float16: float32 initializers
and inputs become half, and half outputs come back as float32, as a float32 model declares
them (give the tool ``--target-precision float16``).

Each run JIT-compiles the model's kernels (one clang or LLVM compile per kernel not in
tinygrad's cache), so it declares on stderr that it compiles and the searches spare its runs.
An op tinygrad's runner lacks comes back as its own words, "op='LSTM' is not supported", which
onnx-bisect reads as ``unsupported``.
"""

from __future__ import annotations

import sys
import warnings
import zipfile
from typing import Any

import numpy as np


def _save(path: str, tensors: dict[str, Any]) -> None:
    # Entry by entry: np.savez(**tensors) would swallow outputs named "file" or "allow_pickle".
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name, value in tensors.items():
            with zf.open(f"{name}.npy", "w", force_zip64=True) as f:
                np.lib.format.write_array(f, np.asarray(value), allow_pickle=False)


def _numpy(value: Any) -> Any:
    """An output as numpy: a tinygrad Tensor realized, a Python constant (a folded shape) as is."""
    return value.numpy() if hasattr(value, "numpy") else np.asarray(value)


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    model_path, inputs_path, outputs_path = argv
    print("onnx-bisect-capability: compiles", file=sys.stderr)
    from tinygrad.nn.onnx import OnnxRunner  # after DEV is set: tinygrad reads it on import

    runner = OnnxRunner(model_path)
    with np.load(inputs_path, allow_pickle=False) as z:
        feeds = {name: z[name] for name in z.files}
    half = _half(runner)
    if half:
        feeds = {k: v.astype(np.float16) if v.dtype == np.float32 else v for k, v in feeds.items()}
    try:
        outputs = runner(feeds)
    except NotImplementedError as exc:  # an op its runner lacks: its words, on one line
        print(f"tinygrad: {exc}", file=sys.stderr)
        return 3
    values = {name: _numpy(value) for name, value in outputs.items()}
    if half:  # as the model declares them (float32), from half
        values = {
            k: v.astype(np.float32) if v.dtype == np.float16 else v for k, v in values.items()
        }
    _save(outputs_path, values)
    return 0


def _half(runner: Any) -> bool:
    """With ``DEFAULT_FLOAT=HALF``, the model's float32 initializers as half; whether so."""
    from tinygrad import dtypes

    if dtypes.default_float != dtypes.half:
        return False
    # Its runner warns for every float32 input fed half: the point of the setting.
    warnings.filterwarnings("ignore", message="input .* has mismatch on dtype")
    values = runner.graph_values
    for name, value in list(values.items()):
        if value is not None and getattr(value, "dtype", None) == dtypes.float32:
            values[name] = value.cast(dtypes.half)
    return True


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
