"""Running an in-process backend in a child process, so that a crash cannot take the tool down.

The parent speaks the exec: protocol to ``python -m onnx_bisect.backends.child SPEC MODEL INPUTS
OUTPUTS``; the child builds the backend from SPEC and runs it. A segfault or abort in the
runtime kills only the child, and the parent reports it as a ``BackendCrash``.

A compiler in a child per run would lose what it compiled with each child, so a sandbox of a
backend that declares ``compiles`` gives its children one folder to keep compiled models in
(``backends/compiled.py``), made in the command's temporary folder and removed with it.
"""

from __future__ import annotations

import shlex
import shutil
import sys
import tempfile
import weakref
from dataclasses import replace
from pathlib import Path

from onnx_bisect.backends.compiled import COMPILED_DIR_ENV
from onnx_bisect.backends.exec import ExecBackend
from onnx_bisect.backends.protocol import Capabilities
from onnx_bisect.backends.spec import BackendSpec
from onnx_bisect.graph.save import save_for_child
from onnx_bisect.process import python_child_env

__all__ = ["SandboxBackend"]


class SandboxBackend(ExecBackend):
    """``spec`` run in a fresh ``python -m onnx_bisect.backends.child`` process per call."""

    # The child reads the model with ``read_model(own=True)``: the weights stay where they are.
    save = staticmethod(save_for_child)

    def __init__(
        self,
        spec: BackendSpec,
        timeout: float | None = None,
        inner: Capabilities | None = None,
    ) -> None:
        self.inner_spec = spec
        argv = [sys.executable, "-m", "onnx_bisect.backends.child", spec.text]
        command = shlex.join(argv) + " {model} {inputs} {outputs}"
        super().__init__(BackendSpec(text=spec.text, name="exec", device=command), timeout)
        self.spec = spec  # reports name the backend the user asked for
        # What the runtime declares holds in the child too (a compiler still compiles every
        # run, so the searches still spare runs); a stream cannot cross the process boundary.
        self.capabilities = replace(inner or Capabilities(), child_process=True, streams=False)
        self._compiled: str | None = None

    def _hint(self, said: str) -> str:
        return ""  # the program is onnx-bisect's own child: the user chose no interpreter

    def environment(self) -> dict[str, str]:
        env = python_child_env()
        if self.capabilities.compiles:
            env[COMPILED_DIR_ENV] = self._compiled_dir()
        return env

    def _compiled_dir(self) -> str:
        """This backend's folder of compiled models, made at its first run (in the command's
        temporary folder, which the CLI removes; removed with the backend otherwise)."""
        if self._compiled is None or not Path(self._compiled).is_dir():
            self._compiled = tempfile.mkdtemp(prefix="onnx-bisect-compiled-")
            weakref.finalize(self, shutil.rmtree, self._compiled, True)
        return self._compiled

    def describe(self) -> str:
        return f"{self.inner_spec.text} (in a child process per run)"
