"""The slow lane's list names tests that exist: a renamed test would otherwise leave it quietly
and run in `make test`'s lane, whose time budget it would spend."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT, slow_listed


def test_every_listed_slow_test_is_collected() -> None:
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "-p", "no:xdist", "tests"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    ).stdout.splitlines()  # fmt: skip
    ids = {line.strip() for line in collected if "::" in line}
    functions = {i.split("[", 1)[0] for i in ids}
    missing = sorted(t for t in slow_listed() if t not in ids and t not in functions)
    assert not missing, f"tests/slow_tests.txt names tests that do not exist: {missing}"
