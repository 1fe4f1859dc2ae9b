"""The child side of ``SandboxBackend``:
``python -m onnx_bisect.backends.child SPEC MODEL INPUTS OUTPUTS``.

Kept out of the package's imports so that ``-m`` runs it fresh.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from onnx_bisect.backends.exec import NOTE_PREFIX
from onnx_bisect.backends.protocol import BackendBase
from onnx_bisect.backends.registry import create_backend
from onnx_bisect.backends.spec import parse_spec
from onnx_bisect.errors import OnnxBisectError
from onnx_bisect.graph.weights import read_model
from onnx_bisect.inputs.feeds import save_npz

__all__ = ["main"]


def main(argv: list[str]) -> int:
    if len(argv) != 4:
        print(
            "usage: python -m onnx_bisect.backends.child SPEC MODEL INPUTS OUTPUTS", file=sys.stderr
        )
        return 2
    spec, model_path, inputs, outputs = argv
    try:
        backend = create_backend(parse_spec(spec))
        # The weights stay in the user's files, located absolutely, as in the parent.
        model = read_model(Path(model_path), own=True)
        with np.load(inputs, allow_pickle=False) as z:
            feeds = {k: z[k] for k in z.files}
        save_npz(Path(outputs), backend.run(model, feeds))
        notes = backend.notes() if isinstance(backend, BackendBase) else []
        for note in notes:  # the parent puts them in the report
            print(f"{NOTE_PREFIX} {note}", file=sys.stderr)
    except OnnxBisectError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
