from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from onnx_bisect.engine.oracle import child as oracle_child  # noqa: E402
from tests.oracle_pool import OraclePool  # noqa: E402


@pytest.fixture
def py() -> str:
    """The interpreter running the tests (the project's venv), for exec: commands."""
    return sys.executable


@pytest.fixture(scope="session")
def oracle_pool() -> Iterator[OraclePool]:
    pool = OraclePool()
    yield pool
    pool.close()


@pytest.fixture(autouse=True)
def _reused_oracle(
    request: pytest.FixtureRequest, oracle_pool: OraclePool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In-process diagnoses share this worker's float64 oracle processes (tests/oracle_pool.py
    says why and what that leaves out); ``fresh_oracle`` tests get the product's own, with no
    pooled child alive beside them."""
    if request.node.get_closest_marker("fresh_oracle") is not None:
        oracle_pool.close()
        return
    monkeypatch.setattr(oracle_child, "take_child", oracle_pool.take)
    monkeypatch.setattr(oracle_child, "prewarm", oracle_pool.prewarm)
