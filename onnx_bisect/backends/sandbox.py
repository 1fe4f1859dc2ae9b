"""Running an in-process backend in a child process, so that a crash cannot take the tool down.

The parent speaks the exec: protocol to ``python -m onnx_bisect.backends.child SPEC MODEL INPUTS
OUTPUTS``; the child builds the backend from SPEC and runs it. A segfault or abort in the
runtime kills only the child, and the parent reports it as a ``BackendCrash``.
"""

from __future__ import annotations

import shlex
import sys

from onnx_bisect.backends.exec import ExecBackend
from onnx_bisect.backends.spec import BackendSpec
from onnx_bisect.graph.save import save_for_child
from onnx_bisect.process import python_child_env

__all__ = ["SandboxBackend"]


class SandboxBackend(ExecBackend):
    """``spec`` run in a fresh ``python -m onnx_bisect.backends.child`` process per call."""

    # The child reads the model with ``read_model(own=True)``: the weights stay where they are.
    save = staticmethod(save_for_child)

    def __init__(self, spec: BackendSpec, timeout: float | None = None) -> None:
        self.inner_spec = spec
        argv = [sys.executable, "-m", "onnx_bisect.backends.child", spec.text]
        command = shlex.join(argv) + " {model} {inputs} {outputs}"
        super().__init__(BackendSpec(text=spec.text, name="exec", device=command), timeout)
        self.spec = spec  # reports name the backend the user asked for

    def environment(self) -> dict[str, str]:
        return python_child_env()

    def describe(self) -> str:
        return f"{self.inner_spec.text} (in a child process per run)"
