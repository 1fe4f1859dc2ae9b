"""The float64 oracle's process, reused by the diagnoses a test worker runs in-process.

The product starts ``python -m onnx_bisect.engine.oracle.child`` for every ``--threshold auto``
diagnosis and closes it after its one job; the child's import of torch costs 1.5-2 CPU
seconds. The suite runs a few hundred such diagnoses, and those imports were nearly half of
its CPU time. The child's loop answers any number of jobs (one JSON line each, until end of
input), so here a worker keeps its children and hands one out per job: the same module, the
same protocol over the same pipes, in a real process that can be killed; only its start and
its torch import are shared.

Each ``take_child`` gets a ``Lease``: ``compute`` sends through the pooled child; ``kill``
kills it (a cancelled diagnosis, a test simulating an out-of-memory kill), after which it is
never reused; ``close`` hands it back, unless its job did not finish (an answer still on the
way must not reach the next job) or it died. A lease closed once is inert: a late ``kill`` of
the product's (which would have hit a dead process) cannot reach a child that another job
holds by then. ``prewarm`` makes sure an idle child exists, as the console script's prewarm
does for its one command.

What a pooled child does not show: a fresh process per diagnosis. tests/test_float64_child.py
(the child's own life: prewarmed, used once, closed, stopped when unused) and tests marked
``fresh_oracle`` run the product's own ``take_child`` and ``prewarm``, with no pooled child
alive; so do console-script subprocesses, whose children are their own.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from typing import Any

from onnx_bisect.engine.oracle import child as oracle_child

__all__ = ["Lease", "OraclePool"]


class Lease:
    """One job's use of a pooled ``OracleChild``, with the product's ``OracleChild`` calls."""

    def __init__(self, pool: OraclePool, child: oracle_child.OracleChild) -> None:
        self._pool, self._child = pool, child
        self._lock = threading.Lock()
        self._returned = False
        self._finished = True  # no job sent yet, so none is in flight

    @property
    def _proc(self) -> Any:
        return self._child._proc

    def compute(self, job: Mapping[str, Any]) -> dict[str, Any]:
        with self._lock:
            if self._returned:
                raise ChildProcessError("the float64 oracle's lease was already closed")
            self._finished = False
        answer = self._child.compute(job)
        self._finished = True
        return answer

    def kill(self) -> None:
        with self._lock:
            if not self._returned:
                self._child.kill()

    def close(self) -> None:
        with self._lock:
            if self._returned:
                return
            self._returned = True
        self._pool.give_back(self._child, reusable=self._finished)


class OraclePool:
    """Idle oracle children of this process (at most ``size``), started on demand."""

    def __init__(self, size: int = 2) -> None:
        self._size = size
        self._idle: list[oracle_child.OracleChild] = []
        self._lock = threading.Lock()
        self._owner = os.getpid()  # a forked copy must not share our children's pipes
        self._fresh = oracle_child.take_child  # the product's, for such a copy
        self.started = 0

    def _new(self) -> oracle_child.OracleChild:
        self.started += 1
        return oracle_child.OracleChild()

    def take(self) -> Lease | oracle_child.OracleChild:
        if os.getpid() != self._owner:
            return self._fresh()
        with self._lock:
            alive = [c for c in self._idle if c._proc.poll() is None]
            dead = [c for c in self._idle if c not in alive]
            child = alive.pop() if alive else None
            self._idle = alive
        for c in dead:
            c.close()
        if child is None:
            child = self._new()
        child._stderr.clear()  # a death's message quotes this job's stderr only, as when fresh
        return Lease(self, child)

    def prewarm(self) -> None:
        if os.getpid() != self._owner:
            return
        with self._lock:
            if any(c._proc.poll() is None for c in self._idle):
                return
        child = self._new()
        self.give_back(child, reusable=True)

    def give_back(self, child: oracle_child.OracleChild, *, reusable: bool) -> None:
        with self._lock:
            keep = reusable and child._proc.poll() is None and len(self._idle) < self._size
            if keep:
                self._idle.append(child)
        if not keep:
            child.close()

    def close(self) -> None:
        """Stop every idle child (running leases close theirs when their job ends)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for child in idle:
            child.close()
