"""torch's global numerics switches (TF32, deterministic kernels), set for one run and restored.

They are process-wide in torch, so a run sets them on entry and puts back what it found:
a reference and a target in one process must not leak settings into each other. The engine
runs the reference and the target in two threads at once, so the whole run holds one lock:
without it, ``torch:cuda?tf32=0`` against ``?tf32=1`` computed both sides with whichever
flags the other thread had set last, and matched (seen on an H100).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from threading import RLock
from typing import Any

import torch

__all__ = ["intra_op_threads", "numerics"]

_GLOBAL_FLAGS = RLock()  # reentrant: a subgraph run inside a run must not deadlock


@contextmanager
def numerics(*, tf32: bool, deterministic: bool | None) -> Iterator[None]:
    with _GLOBAL_FLAGS:
        saved = _read()
        try:
            _set_tf32(tf32)
            if deterministic is not None:
                _set_deterministic(deterministic, warn_only=True)
                torch.backends.cudnn.deterministic = deterministic
                torch.backends.cudnn.benchmark = not deterministic and saved["benchmark"]
            yield
        finally:
            _restore(saved)


@contextmanager
def intra_op_threads(count: int | None) -> Iterator[None]:
    """torch's intra-op threads set to ``count`` for this thread, then restored. Unlike the
    switches above this needs no lock: torch's CPU parallelism here is OpenMP's, whose thread
    count is per calling thread (MKL's too, through OpenMP), so a run in another thread keeps
    its own. A float64 oracle of small tensors beside other busy threads needs it: with two
    threads on two busy cores each 64x16 float64 MatMul waited ~8 ms for its OpenMP team
    (measured), against 5 us with one."""
    if count is None:
        yield
        return
    saved = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def _set_tf32(on: bool) -> None:
    matmul: Any = torch.backends.cuda.matmul
    cudnn: Any = torch.backends.cudnn
    if hasattr(matmul, "fp32_precision"):  # torch >= 2.9: the flags below are deprecated
        matmul.fp32_precision = "tf32" if on else "ieee"
        cudnn.conv.fp32_precision = "tf32" if on else "ieee"
        cudnn.rnn.fp32_precision = "tf32" if on else "ieee"
    else:
        matmul.allow_tf32 = on
        cudnn.allow_tf32 = on


def _set_deterministic(on: bool, *, warn_only: bool) -> None:
    # Only on a change: the setter imports torch._inductor (about 2 s on a cold process),
    # which would double the float64 oracle's cost on a plain run that changes nothing.
    now = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    if now != (on, warn_only):
        torch.use_deterministic_algorithms(on, warn_only=warn_only)


def _read() -> dict[str, Any]:
    cudnn: Any = torch.backends.cudnn  # the fp32_precision attributes are not in the stubs
    matmul: Any = torch.backends.cuda.matmul
    saved: dict[str, Any] = {
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "cudnn_deterministic": cudnn.deterministic,
        "benchmark": cudnn.benchmark,
    }
    if hasattr(matmul, "fp32_precision"):
        saved["precision"] = (
            matmul.fp32_precision, cudnn.conv.fp32_precision, cudnn.rnn.fp32_precision
        )  # fmt: skip
    else:
        saved["allow"] = (matmul.allow_tf32, cudnn.allow_tf32)
    return saved


def _restore(saved: dict[str, Any]) -> None:
    cudnn: Any = torch.backends.cudnn  # the fp32_precision attributes are not in the stubs
    matmul: Any = torch.backends.cuda.matmul
    _set_deterministic(saved["deterministic"], warn_only=saved["warn_only"])
    cudnn.deterministic, cudnn.benchmark = saved["cudnn_deterministic"], saved["benchmark"]
    if "precision" in saved:
        matmul.fp32_precision, cudnn.conv.fp32_precision, cudnn.rnn.fp32_precision = saved[
            "precision"
        ]
    else:
        matmul.allow_tf32, cudnn.allow_tf32 = saved["allow"]
