"""Isolation: each node computed on the target from the reference's own inputs."""

from __future__ import annotations

import contextvars
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy.typing as npt

from onnx_bisect.backends.protocol import Tensors
from onnx_bisect.backends.unsupported import unsupported
from onnx_bisect.compare.criterion import Comparison, Criterion
from onnx_bisect.compare.tensors import compare_tensors
from onnx_bisect.engine.measure.operands import reference_fed
from onnx_bisect.engine.measure.runs import plan_chunks, timed_run
from onnx_bisect.engine.measure.store import TensorStore
from onnx_bisect.engine.session import Session
from onnx_bisect.errors import BackendCrash, BackendError
from onnx_bisect.graph.extract import isolation_model
from onnx_bisect.graph.view import LoadedModel, NodeInfo

__all__ = [
    "ISOLATION_BATCH_BYTES",
    "ISOLATION_BATCH_NODES",
    "ISOLATION_WORKERS",
    "SLOW_RUN_S",
    "IsolationFailure",
    "isolate",
]

Feeds = Mapping[str, npt.NDArray[Any]]


@dataclass(frozen=True)
class IsolationFailure:
    """The target could not run a node alone: ``message`` for one line, ``detail`` in full."""

    message: str
    crashed: bool = False
    detail: str | None = None

    @property
    def unsupported(self) -> bool:
        return unsupported(self.detail or self.message)


def isolate(
    session: Session,
    store: TensorStore,
    nodes: Sequence[NodeInfo] | None = None,
    *,
    loaded: LoadedModel | None = None,
    budget: int | None = None,
) -> dict[str, dict[str, Comparison] | IsolationFailure]:
    """Each node computed on the target from the reference's inputs, compared per output.

    ``loaded`` is the model the nodes come from (the session's by default; the target model in
    two-model mode). Nodes are batched into isolation models of at most ``budget`` bytes of
    inputs plus outputs. A batch the target cannot run is split in halves until the failing
    nodes stand alone.
    """
    model = loaded or session.loaded
    # Past ISOLATION_BATCH_BYTES a batch costs more memory than it saves time, unless each
    # batch is a compile or a slow run: then fewer, larger batches win.
    slow = session.target.capabilities.compiles or _slow(session)
    cap = session.memory.isolation if slow else ISOLATION_BATCH_BYTES
    limit = min(session.memory.isolation, cap) if budget is None else budget
    limit = min(limit, session.memory.isolation // _workers(session))  # in flight share it
    known = set(model.initializers) | set(session.feeds) | {""}
    todo = [
        n
        for n in (model.nodes if nodes is None else nodes)
        if n.outputs
        and n.name not in model.constant_nodes  # judged by value alone (engine/judge.py)
        and _reference_known(n, known, store)
    ]
    sizes: dict[str, int | None] = {
        n.name: sum(store.nbytes(t) for t in (*n.inputs, *n.outputs) if t in store) for n in todo
    }
    # Bodies read outer-scope names directly, so such nodes go alone (see isolation_model).
    batches = _batches([n for n in todo if not n.implicit_inputs], sizes, limit)
    batches += [[n] for n in todo if n.implicit_inputs]
    results: dict[str, dict[str, Comparison] | IsolationFailure] = {}

    def use(batch: list[NodeInfo], outcome: Outcome) -> None:
        if isinstance(outcome, BackendError):  # a node the target cannot run alone
            name = batch[0].name
            results[name] = IsolationFailure(
                str(outcome), isinstance(outcome, BackendCrash), outcome.full
            )
            return
        crit = session.crit.for_isolation()  # a lower precision's isolated floors
        for n in batch:
            results[n.name] = {t: _compared(model, t, store, outcome, crit) for t in n.outputs}

    _run_batches(session, model, store, batches, use)
    return {n.name: results[n.name] for n in todo}  # in graph order, however they ran


Outcome = Tensors | BackendError


def _compared(
    model: LoadedModel, tensor: str, store: TensorStore, outcome: Tensors, crit: Criterion
) -> Comparison:
    """The target's output in real units (a quantized model's dequantized) against the
    reference's."""
    ref = store.get(tensor)
    return compare_tensors(tensor, ref, model.as_real(tensor, outcome.get(tensor), ref.dtype), crit)


def _run_batches(
    session: Session,
    loaded: LoadedModel,
    store: TensorStore,
    batches: list[list[NodeInfo]],
    use: Callable[[list[NodeInfo], Outcome], None],
) -> None:
    """Each batch's outputs on the target, to ``use`` as each wave settles (kept until the
    end, every node's outputs would be held at once); a batch it cannot run is split in
    halves until the failing nodes stand alone (their error is their outcome).

    Where every run is a process of its own, ``workers`` batches run at once: the batches
    are independent, and a diagnosis of a 20,000-node model through exec: spent most of its
    isolation waiting on one child at a time. A batch that fails beside another is run again
    alone before it is split, so a runtime that cannot run twice at once (one device, say)
    is not blamed for that.
    """
    workers = _workers(session)
    pending = list(reversed(batches))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="isolate") as pool:
        while pending:
            wave = [pending.pop() for _ in range(min(workers, len(pending)))]
            # Each in a copy of this context, so that its run counts in this phase.
            jobs = [
                pool.submit(contextvars.copy_context().run, _attempt, session, loaded, store, b)
                for b in wave
            ]
            # The whole wave first: a retry alone must not overlap a run still going.
            outcomes = [job.result() for job in jobs]
            del jobs  # each future holds its outcome
            for i, batch in enumerate(wave):
                outcome, outcomes[i] = outcomes[i], {}
                if isinstance(outcome, BackendError) and len(wave) > 1:
                    outcome = _attempt(session, loaded, store, batch)
                if not isinstance(outcome, BackendError) or len(batch) == 1:
                    use(batch, outcome)
                    del outcome  # not held through the next wave
                    continue
                pending += _split(batch, outcome)


def _split(batch: list[NodeInfo], error: BackendError) -> list[list[NodeInfo]]:
    """A failing batch in parts, the part to run first last (``pending`` is a stack): the
    node the runtime's message names, alone, then the rest (two runs per failing node where
    the runtime says which, as ONNX Runtime's "Name:'x'" and tract's ``node #6 "x"`` do);
    else halves (a bisection: about two runs per failing node per halving)."""
    named = _named(batch, error.full)
    if named is not None and len(batch) > 2:
        return [[n for n in batch if n is not named], [named]]
    half = len(batch) // 2
    return [batch[half:], batch[:half]]


def _named(batch: Sequence[NodeInfo], message: str) -> NodeInfo | None:
    """The one node of ``batch`` the message names in quotes (or after "node "), else None."""
    found = [
        n
        for n in batch
        if any(f.format(n.name) in message for f in ("'{}'", '"{}"', "node {} ", "node {}:"))
    ]
    return found[0] if len(found) == 1 else None


def _slow(session: Session) -> bool:
    """Whether the target's runs so far took SLOW_RUN_S or more each, on the mean."""
    runs = session.stats.runs.get("target", 0)
    return runs > 0 and session.stats.seconds.get("target", 0.0) / runs >= SLOW_RUN_S


def _workers(session: Session) -> int:
    """Isolation runs at once: two where each run starts a process of its own and runs may
    overlap (``parallel``) on more than one core, else one."""
    if not (session.options.parallel and session.target.capabilities.process_per_run):
        return 1
    return min(ISOLATION_WORKERS, _cores())


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def _attempt(
    session: Session, loaded: LoadedModel, store: TensorStore, batch: Sequence[NodeInfo]
) -> Outcome:
    try:
        return _run_isolated(session, loaded, store, batch)
    except BackendError as exc:
        return exc


def _batches(
    nodes: Sequence[NodeInfo], sizes: Mapping[str, int | None], limit: int
) -> list[list[NodeInfo]]:
    """``nodes`` in order, in batches of at most ``limit`` bytes and ISOLATION_BATCH_NODES
    nodes, a chunk over that count split evenly."""
    by_name = {n.name: n for n in nodes}
    batches: list[list[NodeInfo]] = []
    for chunk in plan_chunks(list(by_name), sizes, limit):
        size = -(-len(chunk) // -(-len(chunk) // ISOLATION_BATCH_NODES))
        batches += [[by_name[c] for c in chunk[i : i + size]] for i in range(0, len(chunk), size)]
    return batches


def _reference_known(node: NodeInfo, known: set[str], store: TensorStore) -> bool:
    """Whether the reference's values of every input and output are at hand (a dumped
    reference may hold only some tensors); ``known``: initializers and feeds."""
    return all(t in known or t in store for t in node.inputs) and all(
        o in store for o in node.outputs
    )


def _run_isolated(
    session: Session, loaded: LoadedModel, store: TensorStore, batch: Sequence[NodeInfo]
) -> dict[str, npt.NDArray[Any]]:
    model, feeds = reference_fed(
        loaded, store, session.feeds, batch,
        lambda metas, constants: isolation_model(loaded, batch, metas, constants),
    )  # fmt: skip
    return timed_run(session.target, model, feeds, "target", session.stats)


# An isolation batch holds the reference's inputs and the target's outputs of every node in it,
# with no buffer reuse between them. Past this size a batch costs more memory than it saves
# time: on YOLOv8n-320 one batch took 0.82 s at 434 MB peak, three took 0.93 s at 343 MB.
ISOLATION_BATCH_BYTES = 64 << 20

# A target whose runs take this long each (seconds: tract optimizing a large model, a
# runtime on a slow device) gets batches as large as the memory plan allows, as a compiler
# does: each batch then costs a run of seconds, and at 64 MB a model of large activations
# gets a batch for every node or few.
SLOW_RUN_S = 1.0

# Child processes running isolation batches at once (see _run_batches).
ISOLATION_WORKERS = 2

# Setting up a runtime is not linear in the size of the model: ONNX Runtime's session of an
# isolation model of 13,333 nodes took 2.2 s against 0.09 s for 1,000, and its run checks
# each feed against a list of every input (quadratic). A cap on nodes keeps each session
# small, so isolation is linear in the node count; each batch costs a run, so not too small.
ISOLATION_BATCH_NODES = 8192
