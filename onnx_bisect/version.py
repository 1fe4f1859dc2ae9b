"""The installed onnx-bisect's version, below every layer: the package exports it, and an
output directory's manifest records which version wrote it."""

from __future__ import annotations

from importlib import metadata

__all__ = ["VERSION"]


def _version() -> str:
    try:
        return metadata.version("onnx-bisect")
    except metadata.PackageNotFoundError:
        # A source tree on sys.path without an install: no metadata says which release it is,
        # and "0+unknown" sorts below every release (PEP 440) rather than posing as one.
        return "0+unknown"


VERSION = _version()
