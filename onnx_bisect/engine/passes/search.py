"""Which optimizer passes make a target diverge: a search over sets of enabled passes.

Pure: ``diverges`` runs the target with only the given passes on and says whether it still
diverges. One guilty pass is the common case, so the search first halves the list assuming
one (⌈log2 P⌉ runs, plus one to verify what it lands on). When the divergence needs two passes
together, or one pass needs another to have run first, that guess fails its check, and
delta debugging (Zeller's ddmin) finds the smallest set of enabled passes that still diverges.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["GuiltySearch", "find_guilty"]

Diverges = Callable[[frozenset[str]], bool]


@dataclass(frozen=True)
class GuiltySearch:
    guilty: tuple[str, ...]  # in the order of ``passes``; () when no subset diverges
    runs: int


def find_guilty(passes: Sequence[str], diverges: Diverges) -> GuiltySearch:
    """The smallest set of ``passes`` that, enabled alone, still diverges (see module). The
    caller has seen the divergence with all of them on and none without any."""
    runs = 0

    def test(enabled: Sequence[str]) -> bool:
        nonlocal runs
        runs += 1
        return diverges(frozenset(enabled))

    order = {p: i for i, p in enumerate(passes)}
    candidates = list(passes)
    while len(candidates) > 1:
        half = candidates[: len(candidates) // 2]
        candidates = half if test(half) else candidates[len(candidates) // 2 :]
    if candidates and test(candidates):
        return GuiltySearch(tuple(candidates), runs)
    if not passes or not test(passes):
        return GuiltySearch((), runs)  # even all of them on alone do not diverge: nothing to name
    found = _ddmin(list(passes), test)
    return GuiltySearch(tuple(sorted(found, key=order.__getitem__)), runs)


def _ddmin(config: list[str], test: Callable[[Sequence[str]], bool]) -> list[str]:
    """A 1-minimal subset of ``config`` (assumed to diverge) that diverges."""
    n = 2
    while len(config) >= 2:
        size = -(-len(config) // n)
        chunks = [config[i : i + size] for i in range(0, len(config), size)]
        for chunk in chunks:
            if test(chunk):
                config, n = chunk, 2
                break
        else:
            for chunk in chunks:
                rest = [p for p in config if p not in chunk]
                if rest and test(rest):
                    config, n = rest, max(n - 1, 2)
                    break
            else:
                if n >= len(config):
                    break
                n = min(len(config), 2 * n)
    return config
