"""What a two-model diagnosis needs before it observes the target: the reference's values of
every tensor, the name matching and, for a quantized target, its pairing and the per-tensor
quantization table.

None of it needs the criterion, so for a quantized target it is done while the float64
oracle still measures (``Session.early``): the table is ready as soon as the reference is
scanned (YOLOv8n-320 QDQ: it waited about 3 s for the oracle, which only the comparisons
after it need), as onnxruntime's ``qdq_loss_debug`` gives its own.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass

from onnx_bisect.engine.measure.memory import MemoryPlan
from onnx_bisect.engine.measure.observe import scan
from onnx_bisect.engine.measure.store import TensorStore
from onnx_bisect.engine.quant.pairing import QuantPairing, pair_quantized
from onnx_bisect.engine.quant.runtime import with_runtime_scales
from onnx_bisect.engine.quant.table import quant_rows
from onnx_bisect.engine.session import Session
from onnx_bisect.errors import BackendError
from onnx_bisect.graph.match import Matching, match_tensors
from onnx_bisect.graph.qdq import is_quantized, is_weight_only
from onnx_bisect.graph.view import LoadedModel
from onnx_bisect.quant_result import QuantRow

__all__ = ["PRELUDE", "Prelude", "prelude", "prepare_early", "quantized_target"]

log = logging.getLogger(__name__)

# Its key in ``Session.prepared``.
PRELUDE = "two-model prelude"


@dataclass(frozen=True)
class Prelude:
    """The reference's values, the name matching, a quantized target's pairing and table,
    and when the table was ready (seconds from the start)."""

    store: TensorStore
    matching: Matching
    quant: QuantPairing | None
    rows: tuple[QuantRow, ...]
    ready: float

    @property
    def pairs(self) -> dict[str, str]:
        m = self.matching.pairs
        return {**m, **self.quant.pairs} if self.quant is not None else dict(m)


def quantized_target(session: Session) -> bool:
    """A quantized target model of a float one."""
    other = session.setup.target_model
    if other is None or is_quantized(session.loaded) or is_weight_only(session.loaded):
        return False
    return is_quantized(other) or is_weight_only(other)


def prepare_early(session: Session) -> None:
    """For a quantized target, the prelude as ``Session.early`` work: done while the float64
    oracle measures, if it does (a reference that fails is left for the strategy to meet)."""
    if not quantized_target(session) or not _beside_oracle(session.memory):
        return

    def job() -> None:
        with contextlib.suppress(BackendError):
            session.prepared[PRELUDE] = _prelude(session)

    session.early.append(job)


def _beside_oracle(memory: MemoryPlan) -> bool:
    """Whether the reference's scan fits the budget beside the oracle: measured alongside,
    it marks every probe in one float64 run (``oracle_beside``), twice the probes and the
    working set; the screen's runs it was planned beside are over, but a scan marks every
    probe too. Where both do not fit, the scan waits for the oracle, as it would unhurried."""
    return 3 * (memory.probes + memory.working) <= memory.free


def prelude(session: Session) -> Prelude:
    """The prelude done early, or now."""
    session.early.clear()
    done = session.prepared.pop(PRELUDE, None)
    if isinstance(done, Prelude):
        return done
    with session.timer.stage("scan"):
        return _prelude(session)


def _prelude(session: Session) -> Prelude:
    other = session.setup.target_model
    assert other is not None  # only the two-model strategy has a prelude
    store = session.store("reference")
    scan(session, store, observe_target=False)
    matching = match_tensors(session.loaded, other)
    quant = _pairing(session, other, matching, store)
    rows: tuple[QuantRow, ...] = ()
    if quant is not None:
        pairs = {**matching.pairs, **quant.pairs}
        rows = quant_rows(other, quant, pairs, store.view(pairs))
    ready = time.perf_counter() - session.timer.started
    if quant is not None:
        log.info("per-tensor quantization table: %d tensors, %.2f s", len(rows), ready)
    return Prelude(store, matching, quant, rows, ready)


def _pairing(
    session: Session, other: LoadedModel, matching: Matching, store: TensorStore
) -> QuantPairing | None:
    """A quantized target model of a float one: its integers paired in real units. The
    float model's inputs they stand for go to the store (a scan keeps node outputs only)."""
    if not quantized_target(session):
        return None
    quant = pair_quantized(session.loaded, other, matching)
    for name in set(quant.pairs.values()) & set(session.loaded.inputs):
        if name not in store:
            store.put(name, session.feeds[name])
    return with_runtime_scales(session, other, quant, store)
