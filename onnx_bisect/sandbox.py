"""Running an in-process backend in a child process, so that a crash cannot take the tool down.

The parent speaks the exec: protocol to ``python -m onnx_bisect.sandbox SPEC MODEL INPUTS
OUTPUTS``; the child builds the backend from SPEC and runs it. A segfault or abort in the
runtime kills only the child, and the parent reports it as a ``BackendCrash``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import onnx

from onnx_bisect.adapters.base import BackendSpec, create_backend, parse_spec
from onnx_bisect.adapters.exec import ExecBackend
from onnx_bisect.errors import OnnxBisectError
from onnx_bisect.feeds import save_npz

__all__ = ["SandboxBackend", "main"]


class SandboxBackend(ExecBackend):
    """``spec`` run in a fresh ``python -m onnx_bisect.sandbox`` process per call."""

    def __init__(self, spec: BackendSpec, timeout: float | None = None) -> None:
        self.inner_spec = spec
        argv = [sys.executable, "-m", "onnx_bisect.sandbox", spec.text]
        command = " ".join(_quote(a) for a in argv) + " {model} {inputs} {outputs}"
        super().__init__(BackendSpec(text=spec.text, name="exec", device=command), timeout)
        self.spec = spec  # reports name the backend the user asked for

    def environment(self) -> dict[str, str]:
        # The child must import what we import: plugins on sys.path, tests' own modules.
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        return env

    def describe(self) -> str:
        return f"{self.inner_spec.text} (in a child process per run)"


def _quote(arg: str) -> str:
    import shlex

    return shlex.quote(arg)


def main(argv: list[str]) -> int:
    if len(argv) != 4:
        print("usage: python -m onnx_bisect.sandbox SPEC MODEL INPUTS OUTPUTS", file=sys.stderr)
        return 2
    spec, model_path, inputs, outputs = argv
    try:
        backend = create_backend(parse_spec(spec))
        model = onnx.load(model_path, load_external_data=False)
        onnx.external_data_helper.load_external_data_for_model(model, str(Path(model_path).parent))
        with np.load(inputs, allow_pickle=False) as z:
            feeds = {k: z[k] for k in z.files}
        save_npz(Path(outputs), backend.run(model, feeds))
    except OnnxBisectError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
