from __future__ import annotations

import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from onnx_bisect.engine.oracle import child as oracle_child  # noqa: E402
from tests import oracle_zygote  # noqa: E402
from tests.blas import limit_blas_threads  # noqa: E402

limit_blas_threads(1)  # one worker per core already: tests/blas.py says what more threads cost


@pytest.fixture
def py() -> str:
    """The interpreter running the tests (the project's venv), for exec: commands."""
    return sys.executable


@pytest.fixture(scope="session")
def zygote() -> Iterator[oracle_zygote.Zygote | None]:
    if not oracle_zygote.supported():
        yield None
        return
    z = oracle_zygote.Zygote()
    yield z
    z.close()


@pytest.fixture(autouse=True)
def _forked_oracle(
    request: pytest.FixtureRequest,
    zygote: oracle_zygote.Zygote | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In-process diagnoses get float64 oracle processes forked from one that imported torch
    once (tests/oracle_zygote.py says why and what that leaves out); ``fresh_oracle`` tests get
    the product's own ``python -m``."""
    if zygote is None or request.node.get_closest_marker("fresh_oracle") is not None:
        return
    shim = types.SimpleNamespace(Popen=zygote.popen, PIPE=subprocess.PIPE)
    monkeypatch.setattr(oracle_child, "subprocess", shim)


SLOW_LIST = Path(__file__).with_name("slow_tests.txt")


def slow_listed() -> set[str]:
    """Test ids listed in slow_tests.txt (a parametrized test's id may be listed whole, without
    its parameters)."""
    lines = SLOW_LIST.read_text().splitlines()
    return {line.strip() for line in lines if line.strip() and not line.startswith("#")}


def unlisted(listed: set[str], ids: set[str]) -> list[str]:
    """The listed ids that name none of the collected ``ids`` (nor their functions)."""
    functions = {i.split("[", 1)[0] for i in ids}
    return sorted(t for t in listed if t not in ids and t not in functions)


# What this session's collection says of slow_tests.txt, when it collected every test there is
# (``pytest`` or ``pytest tests``, with any -m or -k: they deselect later): the listed ids that
# name no test. test_slow_lane.py reads it instead of collecting the suite once more.
SLOW_LIST_CHECK = pytest.StashKey[list[str]]()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The slow lane: tests listed in slow_tests.txt get the ``slow`` mark, as if decorated."""
    listed = slow_listed()
    for item in items:
        if item.nodeid in listed or item.nodeid.split("[", 1)[0] in listed:
            item.add_marker(pytest.mark.slow)
    whole = {ROOT, ROOT / "tests"}
    if config.args and all(Path(config.rootpath, a).resolve() in whole for a in config.args):
        config.stash[SLOW_LIST_CHECK] = unlisted(listed, {item.nodeid for item in items})
