from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@pytest.fixture
def py() -> str:
    """The interpreter running the tests (the project's venv), for exec: commands."""
    return sys.executable
