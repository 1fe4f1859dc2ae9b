"""Child processes of our own interpreter (sandboxed backends, transforms)."""

from __future__ import annotations

import os
import sys

__all__ = ["python_child_env"]


def python_child_env() -> dict[str, str]:
    """The environment for a ``python -m onnx_bisect....`` child: it must import what we
    import (plugins on sys.path, tests' own modules)."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
