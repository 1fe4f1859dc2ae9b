"""Versions of everything that took part in a run, for the report."""

from __future__ import annotations

import platform
import sys
from importlib.metadata import PackageNotFoundError, version

import numpy as np
import onnx

from onnx_bisect.backends.protocol import Backend

__all__ = ["environment"]


def environment(*backends: Backend) -> dict[str, str]:
    env = {
        "onnx-bisect": _version("onnx-bisect"),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
        "onnx": onnx.__version__,
        "numpy": np.__version__,
    }
    for b in backends:
        env.update(b.versions())
    return env


def _version(dist: str) -> str:
    try:
        return version(dist)
    except PackageNotFoundError:
        return "unknown"
