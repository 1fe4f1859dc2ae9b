"""Search state that knows nothing of ONNX: binary search over positions, and window growth
over a DAG given as producer lists. The caller runs the backends and answers the questions."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

__all__ = ["CutSearch", "SearchOutcome", "backward_windows", "closure_windows", "forward_windows"]


@dataclass(frozen=True)
class SearchOutcome:
    """Where divergence first appears along the positions, and how sure we are."""

    transition: int  # smallest position found diverged; the node just before it is the suspect
    asked: tuple[tuple[int, bool], ...]  # every position asked, in order, with its answer
    monotone: bool  # False when an extra check contradicted the binary search
    refined: bool  # True when a linear pass around the transition had to decide

    @property
    def runs(self) -> int:
        return len(self.asked)


@dataclass
class CutSearch:
    """Binary search for the first position ``p`` in ``(lo, hi]`` where ``diverged(p)`` holds.

    ``diverged(lo)`` is known False and ``diverged(hi)`` known True. After the search one extra
    position past the transition is checked (unless ``verify`` is off, where each question
    costs a compile): when divergence vanishes there, the predicate is not monotone and a
    linear pass over ``window`` positions on each side decides.
    """

    lo: int
    hi: int
    window: int = 4
    verify: bool = True
    answers: dict[int, bool] = field(default_factory=dict)
    order: list[int] = field(default_factory=list)

    def run(self, diverged: Callable[[int], bool]) -> SearchOutcome:
        lo, hi = self.lo, self.hi
        ask = self._asker(diverged)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if ask(mid):
                hi = mid
            else:
                lo = mid
        monotone, refined = True, False
        upper = self.hi
        if self.verify and hi + 1 < upper and not ask(hi + 1):
            monotone = False
            hi = self._refine(ask, hi)
            refined = True
        asked = tuple((p, self.answers[p]) for p in self.order)
        return SearchOutcome(hi, asked, monotone, refined)

    def _asker(self, diverged: Callable[[int], bool]) -> Callable[[int], bool]:
        def ask(p: int) -> bool:
            if p == self.lo:
                return False
            if p == self.hi:
                return True
            if p not in self.answers:
                self.answers[p] = diverged(p)
                self.order.append(p)
            return self.answers[p]

        return ask

    def _refine(self, ask: Callable[[int], bool], around: int) -> int:
        """First position near ``around`` that diverges and stays diverged one step later."""
        start = max(self.lo + 1, around - self.window)
        stop = min(self.hi, around + self.window)
        for p in range(start, stop + 1):
            if ask(p) and (p + 1 > self.hi or ask(p + 1)):
                return p
        return around


def backward_windows(
    start: int, producers: Mapping[int, Sequence[int]], max_size: int
) -> Iterator[tuple[int, ...]]:
    """Windows of 2..max_size nodes: ``start`` plus its nearest ancestors, breadth first.

    Each window is sorted; each is the previous one plus the next ancestor in BFS order, so
    the first window that reproduces a fault is the smallest of this family.
    """
    yield from _grow(start, producers, max_size)


def forward_windows(
    start: int, consumers: Mapping[int, Sequence[int]], max_size: int
) -> Iterator[tuple[int, ...]]:
    """Like ``backward_windows`` but along consumers: for fused groups that begin at ``start``."""
    yield from _grow(start, consumers, max_size)


def closure_windows(
    start: int,
    producers: Mapping[int, Sequence[int]],
    consumers: Mapping[int, Sequence[int]],
    max_size: int,
) -> Iterator[tuple[int, ...]]:
    """Backward windows closed over fan-out: each ancestor comes with all its consumers.

    A bug that shows only while a tensor is unobserved (a fusion across it) needs every reader
    of that tensor inside the window, or the tensor stays an output; LayerNorm feeding Q, K
    and V is the usual case.
    """
    for window in _grow(start, producers, max_size):
        closed = set(window)
        for m in window:
            if m != start:
                closed.update(consumers.get(m, ()))
        if len(closed) > len(window) and len(closed) <= max_size:
            yield tuple(sorted(closed))


def _grow(
    start: int, edges: Mapping[int, Sequence[int]], max_size: int
) -> Iterator[tuple[int, ...]]:
    seen = {start}
    queue = deque(edges.get(start, ()))
    members = [start]
    while queue and len(members) < max_size:
        nxt = queue.popleft()
        if nxt in seen:
            continue
        seen.add(nxt)
        members.append(nxt)
        queue.extend(edges.get(nxt, ()))
        yield tuple(sorted(members))
