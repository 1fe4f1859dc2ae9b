"""The precision note: when a divergence is the target's reduced precision, not a bad kernel.

A target that computes float32 work in float16, bfloat16 or TF32 is expected to exceed fp32
rounding. The spec usually says so (``?dtype=float16``, ``?tf32=1``, ``+fp16``, OpenVINO's
``precision=``), and then even one culprit gets the note; otherwise many culprits at once
(``widespread``) are the sign.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from onnx_bisect.result import BackendInfo, NodeResult, Verdict

__all__ = ["declared_precision", "fp32_spec", "precision_notes"]

_ON = {"1", "true", "on"}
_NAMES = {"float16": "float16", "bfloat16": "bfloat16", "f16": "float16", "bf16": "bfloat16"}


def precision_notes(nodes: Sequence[NodeResult], target: BackendInfo) -> list[str]:
    """The note for a diagnosis whose culprits a precision policy explains, if any."""
    culprits = [n for n in nodes if n.verdict is Verdict.CULPRIT]
    if not culprits:
        return []
    declared = declared_precision(target)
    fp32 = fp32_spec(target.spec)
    if declared is not None:
        return [
            f"the target computes in {declared}, so errors above fp32 rounding are expected "
            f"from it; compare at fp32 (e.g. {fp32}) to test the kernels themselves"
        ]
    ops = sorted({n.op_type for n in culprits})
    if len(culprits) < 5 or len(culprits) < 0.1 * sum(1 for n in nodes if n.isolated):
        return []
    return [
        f"{len(culprits)} nodes ({', '.join(ops[:4])}) are each wrong on their own: that is "
        "usually the target computing at lower precision (bf16/fp16/TF32) rather than one bad "
        f"kernel; compare at fp32 (e.g. {fp32}) to test the kernels"
    ]


def declared_precision(target: BackendInfo) -> str | None:
    """The reduced precision the target's spec (or its description) asks for, else None."""
    runtime, *transforms = target.spec.split("+")
    if runtime.startswith(("exec:", "dump:")):
        return None  # their query strings belong to the user's command
    if any(t.strip().partition("=")[0] == "fp16" for t in transforms):
        return "float16 (the +fp16 transform)"
    query = dict(kv.partition("=")[::2] for kv in runtime.partition("?")[2].split("&") if kv)
    if query.get("dtype", "").lower() in _NAMES:
        return _NAMES[query["dtype"].lower()]
    if query.get("tf32", "").lower() in _ON:
        return "TF32"
    # OpenVINO says what it picked (bf16 by default on CPUs with AMX/AVX512-BF16).
    found = re.search(r"precision=(b?f16)\b", target.description, re.IGNORECASE)
    return _NAMES[found.group(1).lower()] if found else None


def fp32_spec(target_spec: str) -> str:
    """The target's spec asking for strict float32, for the precision note."""
    runtime = target_spec.split("+", 1)[0]
    if runtime != target_spec and not runtime.startswith(("exec:", "dump:")):
        return runtime  # a +fp16-style transform made the precision: drop it
    name, _, query = runtime.partition("?")
    if name == "mps" or name.startswith("torch"):
        kept = [kv for kv in query.split("&") if kv and not kv.startswith(("dtype=", "tf32="))]
        if name.startswith("torch:cuda"):
            kept.append("tf32=0")
        return name + ("?" + "&".join(kept) if kept else "")
    if name.startswith("openvino"):
        return f"{name}?precision=f32"
    return "the target's fp32 setting"
