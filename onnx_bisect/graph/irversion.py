"""The IR version a model's opsets need, and a copy of a model that declares a lower one.

The IR version says which file-format features a model may use; its opsets say which
operators. ``onnx`` 1.23 saves IR 14 by default even for an opset-17 model, and a runtime that
reads up to IR 10 refuses that file although nothing in it needs more than IR 8.
"""

from __future__ import annotations

import onnx

__all__ = ["lowered", "min_ir_version", "runnable_ir_version"]


# The domains onnx's version table maps to IR versions. Other domains (com.microsoft, a
# user's custom ops) belong to runtimes and say nothing about the file format.
_ONNX_DOMAINS = frozenset(domain for domain, _ in onnx.helper.OP_SET_ID_VERSION_MAP)

# IR 3 brought opset imports; no model that has them can declare less.
_FLOOR = 3


def min_ir_version(model: onnx.ModelProto) -> int | None:
    """The lowest IR version whose onnx release knew every ONNX opset that ``model`` and its
    local functions import; None when one is newer than this onnx package knows, since then
    nothing is known about what it needs."""
    imports = [*model.opset_import, *(o for f in model.functions for o in f.opset_import)]
    needed = _FLOOR
    for opset in imports:
        if (opset.domain or "ai.onnx") not in _ONNX_DOMAINS:
            continue
        try:
            needed = max(needed, onnx.helper.find_min_ir_version_for([opset]))
        except ValueError:  # a version of a known domain that is not in the table
            return None
    return needed


def runnable_ir_version(model: onnx.ModelProto, highest: int) -> int | None:
    """The IR version to run ``model`` at on a runtime that reads up to ``highest``: its own
    when that is not above; ``highest`` when its opsets allow it (the highest keeps every
    feature the runtime knows); None when they need more."""
    if model.ir_version <= highest:
        return model.ir_version
    needed = min_ir_version(model)
    return highest if needed is not None and needed <= highest else None


def lowered(model: onnx.ModelProto, ir_version: int) -> onnx.ModelProto:
    """A copy of ``model`` that declares ``ir_version``. A copy rather than an edit undone
    afterwards: the same model object may be running on the other backend's thread."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    copy.ir_version = ir_version
    return copy
