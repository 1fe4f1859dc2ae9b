"""Which part of ``torch.compile`` makes a ``torch:*?compile=`` target diverge: torch's own
``CompilerBisector``, with our comparison as its test.

The bisector walks the compile backends (eager, aot_eager, aot_eager_decomp_partition,
inductor) to the first that is wrong, then that backend's subsystems (pre/joint/post-grad
passes, config flips, lowerings), disabling each, then the n-th application of the one that
matters. Its test runs the model compiled with the backend it is at, in this process (the
bisector's state is this process's), and says whether the outputs agree.
"""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy.typing as npt
import onnx

from onnx_bisect.backends.protocol import Tensors
from onnx_bisect.backends.torch.backend import TorchBackend
from onnx_bisect.errors import BackendError

__all__ = ["BACKEND_ORDER", "CompileFinding", "bisect_compiler", "fallback_compiler"]

log = logging.getLogger(__name__)

# torch's order; each backend runs all that the one before it does, and more.
BACKEND_ORDER = (
    "eager",
    "aot_eager",
    "aot_eager_decomp_partition",
    "aot_eager_decomp_partition_crossref",
    "inductor",
)


@dataclass(frozen=True)
class CompileFinding:
    """torch's ``BisectionResult``: the first wrong backend, and within it what it could
    narrow down (a subsystem, its n-th application, and what that application was)."""

    backend: str
    subsystem: str | None
    application: int | None
    debug_info: str | None
    runs: int
    config: tuple[str, str, str] | None = None  # (config module, field, value) of a flip


def bisect_compiler(
    backend: TorchBackend,
    model: onnx.ModelProto,
    feeds: Mapping[str, npt.NDArray[Any]],
    diverges: Callable[[Tensors], bool],
) -> CompileFinding | None:
    """torch's bisection of ``backend``'s compile (see module); None when every backend it
    tried agreed (the divergence did not reproduce)."""
    import torch
    from torch._inductor import compiler_bisector as cb

    runs = 0

    def good() -> bool:
        nonlocal runs
        runs += 1
        torch._dynamo.reset()  # a fresh compile under the bisector's current settings
        compiler = cb.CompilerBisector.get_backend() or "inductor"
        try:
            out = backend.run_compiled(model, feeds, compiler)
        except BackendError as exc:  # the symptom changed; count it as still wrong
            log.info("compile bisection: %s failed: %s", compiler, exc)
            return False
        except Exception as exc:  # run_compiled is below BackendBase's error wrapping
            log.info("compile bisection: %s failed: %s", compiler, exc)
            return False
        return not diverges(out)

    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):  # it narrates with print()
            result = cb.CompilerBisector.do_bisect(good)
    finally:
        torch._dynamo.reset()
        log.debug("torch's compiler bisector:\n%s", printed.getvalue())
    if result is None:
        return None
    config = next(
        (
            (s.config_name, s.config_field, repr(s.config_value))
            for s in cb.BACKENDS.get(result.backend, [])
            if isinstance(s, cb.ConfigChange) and s.name == result.subsystem
        ),
        None,
    )
    return CompileFinding(
        result.backend,
        result.subsystem,
        result.bisect_number if config is None else None,
        result.debug_info if config is None else None,
        runs,
        config,
    )


def fallback_compiler(guilty: str) -> str | None:
    """The ``compile=`` value below the guilty backend that ``compile=`` accepts (None: run
    eagerly, no compile at all)."""
    accepted = ("eager", "aot_eager", "inductor")
    before = BACKEND_ORDER[: BACKEND_ORDER.index(guilty)] if guilty in BACKEND_ORDER else ()
    usable = [b for b in before if b in accepted]
    return usable[-1] if usable else None
