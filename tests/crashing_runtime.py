"""An in-process runtime that dies on one node, as real ones do (OpenVINO's segfault reading a
DFT, tract's panic in a Pad, which aborts the process): a plugin adapter, named as
``tests/crashing_runtime.py:Crashing?node=NAME&how=segv|abort|exit`` (``&unseen=TENSOR``:
only while TENSOR is not an output of the model, as a fusion through it that marking undoes).

Any model that holds the node kills the process that runs it: ``segv`` reads address 0
through ctypes (SIGSEGV), ``abort`` calls ``os.abort()`` (SIGABRT, as Rust's "non-unwinding
panic. aborting" does), ``exit`` calls ``os._exit(3)`` (a C library's ``exit``). Every other
model runs on ONNX Runtime. Each run notes the process it ran in, so a test can tell one
long-lived worker from a child per run.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Mapping
from typing import Any

import numpy.typing as npt
import onnx

from onnx_bisect.backends.protocol import BackendBase, Tensors
from onnx_bisect.backends.registry import create_backend
from onnx_bisect.backends.spec import BackendSpec


class Crashing(BackendBase):
    def __init__(self, spec: BackendSpec) -> None:
        super().__init__(spec)
        spec.check_options(["node", "how", "unseen"])
        self.node, self.how = spec.option("node"), spec.option("how", "segv")
        self.unseen = spec.option("unseen", "")
        self.inner = create_backend("cpu")

    def _run(self, model: onnx.ModelProto, feeds: Mapping[str, npt.NDArray[Any]]) -> Tensors:
        self._note(f"ran in process {os.getpid()}", once=True)
        seen = any(o.name == self.unseen for o in model.graph.output)
        if any(n.name == self.node for n in model.graph.node) and not seen:
            print(f"dying on {self.node}", file=sys.stderr, flush=True)
            if self.how == "abort":
                os.abort()
            if self.how == "exit":
                os._exit(3)
            ctypes.string_at(0)
        return self.inner.run(model, feeds)
