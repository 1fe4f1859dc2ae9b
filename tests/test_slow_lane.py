"""The slow lane's list names tests that exist: a renamed test would otherwise leave it quietly
and run in `make test`'s lane, whose time budget it would spend."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT, SLOW_LIST_CHECK, slow_listed, unlisted


def test_every_listed_slow_test_is_collected(request: pytest.FixtureRequest) -> None:
    missing = request.config.stash.get(SLOW_LIST_CHECK, None)
    if missing is None:  # this session did not collect every test: collect them now
        collected = subprocess.run(
            [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
             "-p", "no:xdist", "tests"],
            cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
        ).stdout.splitlines()  # fmt: skip
        missing = unlisted(slow_listed(), {line.strip() for line in collected if "::" in line})
    assert not missing, f"tests/slow_tests.txt names tests that do not exist: {missing}"
