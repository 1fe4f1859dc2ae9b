"""One quantized model on two backends whose outputs move only because its integers flip.

Two runtimes whose float values before a DynamicQuantizeLinear differ at the fp32 level (a
Sigmoid's last bit) round a few elements, or the run-time scale, a step apart: the int8
precision. The layers after it carry those flips on, and a deep network amplifies them (zoo
G12: 47 accumulator elements a step apart became 1.2% at the output, every argmax the same).
Where no node diverges fed the reference's inputs (no culprit, no window) and the first
divergent tensor reads integers that are a step apart and no more, the answer is that
precision, not a divergence.
"""

from __future__ import annotations

from onnx_bisect.engine.found import Found
from onnx_bisect.engine.session import Session
from onnx_bisect.result import CauseKind, NodeResult, RootCause, Verdict
from onnx_bisect.text import fmt

__all__ = ["flips_amplified"]

# Verdicts that say some node is at fault on its own: the flips then explain nothing.
_FAULTS = frozenset(
    {
        Verdict.CULPRIT, Verdict.RANGE, Verdict.PARAMETER, Verdict.REFERENCE_OFF,
        Verdict.PATTERN, Verdict.UNSUPPORTED, Verdict.FAILED, Verdict.CRASHED,
    }
)  # fmt: skip


def flips_amplified(session: Session, found: Found, worst: float | None) -> RootCause | None:
    """The cause where one quantized model's outputs diverge though no node does alone and
    the first divergent tensor descends from integers one step apart (``worst``: the largest
    output rel_l2); None where that is not so."""
    crit, cause, first = session.crit, found.cause, found.first
    gridded = set(crit.quantized or {}) | set(crit.quant_bounds or {})
    if not gridded or cause is None or cause.kind is not CauseKind.NONE or first is None:
        return None
    if session.setup.target_model is not None or any(n.verdict in _FAULTS for n in found.nodes):
        return None
    flipped = [n for n in found.nodes if _flipped(n, gridded) and n.index < first.index]
    upstream = session.loaded.ancestors(first.index)
    feeding = [n for n in flipped if n.index in upstream]
    if not feeding:
        return None
    names = ", ".join(f"{n.op_type} {n.name!r}" for n in feeding[:3])
    more = f" and {len(feeding) - 3} more" if len(feeding) > 3 else ""
    return RootCause(
        CauseKind.PRECISION,
        (),
        f"no node diverges fed the reference's inputs, and the first divergent tensor "
        f"({first.op_type} {first.name!r}) reads integers only one quantization step apart "
        f"({names}{more}: fp32-level differences upstream round a few elements or the "
        f"run-time scale to the neighbouring step); the layers after them amplify those flips "
        f"to the outputs (largest rel_l2 {fmt(worst)}): the int8 precision, not a divergence",
    )


def _flipped(node: NodeResult, gridded: set[str]) -> bool:
    acc = node.accumulated
    return acc is not None and acc.within_precision and acc.tensor in gridded
