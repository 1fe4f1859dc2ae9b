"""Which torch devices this machine has, and what to say when the one asked for is absent."""

from __future__ import annotations

import platform
import sys
from importlib.util import find_spec

from onnx_bisect.errors import BackendUnavailableError

__all__ = [
    "INSTALL",
    "check_device",
    "present_devices",
    "torch_missing",
    "unavailable_without_torch",
]

INSTALL = "pip install 'onnx-bisect[torch]'"
_DUMP_HINT = (
    "run `onnx-bisect dump MODEL --backend {spec} --out DIR` where that device is, then "
    "compare here with --target dump:DIR"
)


def torch_missing() -> str | None:
    """None when torch imports, else what is wrong and the install command."""
    try:
        import torch  # noqa: F401
    except ImportError as exc:
        why = "is not installed" if find_spec_safe("torch") is None else f"does not import ({exc})"
        return f"torch {why}; install it with: {INSTALL}"
    return None


def find_spec_safe(name: str) -> object | None:
    try:
        return find_spec(name)
    except ValueError:  # a module set to None in sys.modules
        return None


def _machine_lacks(device: str) -> str | None:
    """Why this machine cannot have ``device`` whatever torch is installed, or None: said
    together with a missing torch, so that installing it is not the only advice."""
    if device.partition(":")[0] == "mps" and sys.platform != "darwin":
        return f"MPS needs macOS on Apple silicon and this machine runs {platform.system()}"
    return None


def unavailable_without_torch(device: str, spec_text: str, missing: str) -> str:
    """The message for ``device`` when torch is ``missing``: what else stands in the way too."""
    lacks = _machine_lacks(device)
    if lacks is None:
        return f"backend {spec_text!r} is not available: {missing}"
    return (
        f"backend {spec_text!r} is not available here: {lacks}, and {missing}; "
        + _DUMP_HINT.format(spec=spec_text)
    )


def present_devices() -> list[str]:
    """The torch devices usable here, e.g. ``['cpu', 'cuda:0']``."""
    import torch

    found = ["cpu"]
    if torch.cuda.is_available():
        found += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if torch.backends.mps.is_available():
        found.append("mps")
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        found += [f"xpu:{i}" for i in range(xpu.device_count())]
    return found


def check_device(device: str, spec_text: str) -> None:
    """Raise ``BackendUnavailableError`` naming what is missing and what to do instead."""
    import torch

    kind, _, index = device.partition(":")
    present = present_devices()
    if device in present or (kind in ("cuda", "xpu") and not index and f"{kind}:0" in present):
        return
    hint = _DUMP_HINT.format(spec=spec_text)
    if kind == "mps":
        why = _machine_lacks(device) or (
            f"torch {torch.__version__} reports MPS unavailable (needs macOS 12.3+)"
        )
    elif kind == "cuda":
        build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
        why = f"torch {torch.__version__} ({build}) sees no CUDA device {index or ''}".rstrip()
    else:
        why = f"torch {torch.__version__} sees no {device} device"
    raise BackendUnavailableError(f"backend {spec_text!r} is not available here: {why}; {hint}")
