#!/usr/bin/env python3
"""A strict runtime for the exec: protocol: onnx.checker first, then examples/faulty_runtime.py.

    python tests/strict_runtime.py MODEL INPUTS OUTPUTS [--max-outputs N] [FAULTY OPTIONS...]

Like IREE's importer and tinygrad's parser it refuses a model that is not valid ONNX
(``onnx.checker.check_model(full_check=True)``) or that declares an output without an element
type and a shape ("Field 'shape' of 'type' is required but missing"), exit 4. With
``--max-outputs N`` it refuses a model that marks more than N outputs, as a compiler that runs
out of something per output does (exit 4, "too many outputs"). Every other option goes to
examples/faulty_runtime.py, which then runs the model with ONNX Runtime.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import onnx

_FAULTY = Path(__file__).resolve().parents[1] / "examples" / "faulty_runtime.py"


def _refusal(path: str, max_outputs: int | None) -> str | None:
    """Why this runtime refuses the model at ``path``, or None."""
    try:
        onnx.checker.check_model(path, full_check=True)
    except Exception as exc:  # the checker's own exception types vary by version
        return f"invalid model: {exc}"
    model = onnx.load(path, load_external_data=False)
    for v in (*model.graph.output, *model.graph.value_info):
        t = v.type.tensor_type if v.type.HasField("tensor_type") else None
        if t is None or not t.elem_type:
            return f"{v.name}: Field 'elem_type' of 'type' is required but missing"
        if not t.HasField("shape"):
            return f"{v.name}: Field 'shape' of 'type' is required but missing"
    if max_outputs is not None and len(model.graph.output) > max_outputs:
        return f"too many outputs: {len(model.graph.output)} > {max_outputs}"
    return None


def main(argv: list[str]) -> int:
    max_outputs = None
    if "--max-outputs" in argv:
        i = argv.index("--max-outputs")
        max_outputs = int(argv[i + 1])
        argv = argv[:i] + argv[i + 2 :]
    why = _refusal(argv[0], max_outputs)
    if why is not None:
        print(f"error: {why}", file=sys.stderr)
        return 4
    spec = importlib.util.spec_from_file_location("faulty_runtime", _FAULTY)
    assert spec and spec.loader
    faulty = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(faulty)
    code: int = faulty.main(argv)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
