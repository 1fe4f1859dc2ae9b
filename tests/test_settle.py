"""``--threshold auto`` without waiting for the float64 oracle when the final outputs agree
within ``eps``: the verdict cannot depend on the oracle then, so the diagnosis ends at once
and the oracle is stopped. The oracle is made slow here (it waits to be cancelled), so that
what is tested does not depend on timing."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest

import onnx_bisect
from onnx_bisect.engine import diagnose
from onnx_bisect.engine.oracle.float64 import Float64Run, measure_float64
from onnx_bisect.engine.progress import Abandoned
from onnx_bisect.engine.session import Session
from tests.faulty import FaultyBackend
from tests.models import YOLO

NOTE = "the float64 oracle was not waited for"


class SlowOracle:
    """``measure_float64`` that waits ``delay`` seconds, or until the session abandons it."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.cancelled = threading.Event()
        self.hooked = threading.Event()  # what stops a real oracle's child

    def __call__(
        self, session: Session, names: Sequence[str] | None = None, **kwargs: Any
    ) -> Float64Run:
        session.on_cancel(self.hooked.set)
        if session.cancelled.wait(self.delay):
            self.cancelled.set()
            raise Abandoned("stopped")
        return measure_float64(session, names, **kwargs)


@pytest.fixture
def slow(monkeypatch: pytest.MonkeyPatch) -> SlowOracle:
    oracle = SlowOracle(30.0)
    monkeypatch.setattr(diagnose, "measure_float64", oracle)
    return oracle


def test_agreeing_outputs_end_the_diagnosis_without_the_oracle(slow: SlowOracle) -> None:
    start = time.perf_counter()
    result = onnx_bisect.bisect(YOLO, target="cpu?opt=disable")
    assert time.perf_counter() - start < 20  # the oracle would have taken 30 s
    assert result.verdict == "match"
    assert slow.hooked.is_set() and slow.cancelled.wait(5)  # its thread ends at once
    assert any(NOTE in note for note in result.notes)
    assert "float64" not in result.runs
    assert not any("no float64 values" in note for note in result.notes)  # no fallback note
    assert result.criterion.describe().startswith("rel_l2 > 4 × fp32 noise")
    assert all(c.threshold == 1e-5 and c.noise is None for c in result.outputs)


def test_a_divergence_still_waits_for_the_oracle(monkeypatch: pytest.MonkeyPatch) -> None:
    oracle = SlowOracle(1.0)
    monkeypatch.setattr(diagnose, "measure_float64", oracle)
    result = onnx_bisect.bisect(YOLO, target=FaultyBackend("/down1/conv/Conv", 1e-3))
    assert not oracle.cancelled.is_set()
    assert result.root_cause is not None and result.root_cause.nodes == ("/down1/conv/Conv",)
    assert not any(NOTE in note for note in result.notes)
    assert result.runs["float64"] == 2


def test_always_scan_waits_for_the_oracle(monkeypatch: pytest.MonkeyPatch) -> None:
    oracle = SlowOracle(1.0)
    monkeypatch.setattr(diagnose, "measure_float64", oracle)
    result = onnx_bisect.bisect(YOLO, target="cpu?opt=disable", always_scan=True)
    assert not oracle.cancelled.is_set()
    assert result.verdict == "match"
    assert not any(NOTE in note for note in result.notes)
    floors = [n.accumulated.noise for n in result.nodes if n.accumulated is not None]
    assert floors and any(f is not None for f in floors)
