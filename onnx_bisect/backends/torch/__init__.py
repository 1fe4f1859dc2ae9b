"""The torch backend family: ONNX run by torch on any device, dtype and compiler.

Importing this package does not import torch; ``backend.TorchBackend`` does when built.
"""

from __future__ import annotations

from onnx_bisect.backends.torch.backend import TorchBackend

__all__ = ["TorchBackend"]
