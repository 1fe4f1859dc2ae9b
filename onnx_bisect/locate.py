"""The search: screen, scan, isolate, and the verdicts they imply.

The verdict logic (``judge``) is pure: it sees comparisons and node wiring, never ONNX. Graph
surgery comes from ``model``, running from ``run``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from onnx_bisect.adapters.base import Backend
from onnx_bisect.errors import BackendCrash, BackendError
from onnx_bisect.metrics import Comparison, Criterion, compare_tensors
from onnx_bisect.model import LoadedModel, NodeInfo, TensorMeta, isolation_model, with_outputs
from onnx_bisect.result import NodeResult, RootCause, Verdict
from onnx_bisect.run import RunStats, TensorStore, plan_chunks, run_pair, timed_run

__all__ = [
    "IsolationFailure",
    "Observed",
    "culprit_cause",
    "first_divergence",
    "is_constant",
    "reference_operands",
    "isolate",
    "judge",
    "root_cause",
    "scan",
    "screen",
]

log = logging.getLogger(__name__)

Feeds = Mapping[str, npt.NDArray[Any]]

# Phrases runtimes use when they lack a kernel, as opposed to failing while running one.
_UNSUPPORTED = (
    "not implemented",
    "not_implemented",
    "unimplemented",  # tract: Unimplemented(Det)
    "unsupported",
    "no op registered",
    "could not find an implementation",
    "is not supported",
    "cannot create",
    "doesn't support",
    "does not support",
)


@dataclass(frozen=True)
class IsolationFailure:
    message: str
    crashed: bool = False

    @property
    def unsupported(self) -> bool:
        text = self.message.lower()
        return any(p in text for p in _UNSUPPORTED)


@dataclass(frozen=True)
class Observed:
    """Comparisons from a run of both backends, and the target's final outputs from it (kept
    to tell whether marking outputs changed what the target computes)."""

    comparisons: Mapping[str, Comparison]
    target_outputs: Mapping[str, npt.NDArray[Any]]
    ref_outputs: Mapping[str, npt.NDArray[Any]] = field(default_factory=dict)

    @property
    def diverged(self) -> bool:
        return any(c.diverged for c in self.comparisons.values())


def screen(
    ref: Backend,
    target: Backend,
    loaded: LoadedModel,
    feeds: Feeds,
    crit: Criterion,
    stats: RunStats,
    parallel: bool = True,
    target_model: LoadedModel | None = None,
) -> Observed:
    """Plain runs of both backends, compared on the final outputs only (those of both models
    when the target runs ``target_model``)."""
    other = target_model or loaded
    ref_out, tgt_out = run_pair(
        lambda: timed_run(ref, loaded.model, feeds, "ref", stats),
        lambda: timed_run(target, other.model, feeds, "target", stats),
        parallel,
    )
    names = [n for n in loaded.outputs if n in set(other.outputs)]
    shown = [n for n in names if _answered(n, ref, ref_out, target, tgt_out)]
    if not shown:
        raise BackendError(
            "no final output to compare: the models share no output name, or neither backend "
            "holds one"
        )
    return Observed(
        {n: compare_tensors(n, ref_out.get(n), tgt_out.get(n), crit) for n in shown},
        {n: tgt_out[n] for n in shown if n in tgt_out},
        {n: ref_out[n] for n in shown if n in ref_out},
    )


def _answered(
    name: str,
    ref: Backend,
    ref_out: Mapping[str, Any],
    target: Backend | None,
    tgt_out: Mapping[str, Any],
) -> bool:
    """A dump (``partial``) that does not hold a tensor says nothing about it: not a mismatch."""
    missing_ref = name not in ref_out and getattr(ref, "partial", False)
    missing_tgt = name not in tgt_out and getattr(target, "partial", False)
    return not (missing_ref or missing_tgt)


def scan(
    ref: Backend,
    target: Backend | None,
    loaded: LoadedModel,
    feeds: Feeds,
    crit: Criterion,
    sizes: Mapping[str, int | None],
    budget: int,
    store: TensorStore,
    stats: RunStats,
    parallel: bool = True,
) -> Observed:
    """Both backends with every probe marked, in chunks of at most ``budget`` bytes.

    The reference's values go to ``store`` for isolation; the target's are compared and dropped
    (its final outputs are kept). With ``target`` None only the reference runs, to fill
    ``store`` for a search that observes the target elsewhere.
    """
    chunks = plan_chunks(loaded.probes, sizes, budget)
    log.info("scan: %d probes in %d chunk(s)", len(loaded.probes), len(chunks))
    comparisons: dict[str, Comparison] = {}
    finals: dict[str, npt.NDArray[Any]] = {}
    outputs = set(loaded.outputs)
    for i, chunk in enumerate(chunks):
        log.debug("probe run %d/%d (%d tensors)", i + 1, len(chunks), len(chunk))
        marked = with_outputs(loaded.model, chunk)
        if target is None:
            ref_out, tgt_out = timed_run(ref, marked, feeds, "ref", stats), None
        else:
            ref_out, tgt_out = run_pair(
                lambda m=marked: timed_run(ref, m, feeds, "ref", stats),  # type: ignore[misc]
                lambda m=marked: timed_run(target, m, feeds, "target", stats),  # type: ignore[misc]
                parallel,
            )
        for name in chunk:
            if name not in ref_out:  # a dump reference that does not hold it
                continue
            store.put(name, ref_out[name])
            if tgt_out is None or not _answered(name, ref, ref_out, target, tgt_out):
                continue
            comparisons[name] = compare_tensors(name, ref_out[name], tgt_out.get(name), crit)
            if name in outputs and name in tgt_out:
                finals[name] = tgt_out[name]
    return Observed(comparisons, finals)


def isolate(
    target: Backend,
    loaded: LoadedModel,
    feeds: Feeds,
    crit: Criterion,
    budget: int,
    store: TensorStore,
    stats: RunStats,
    nodes: Sequence[NodeInfo] | None = None,
) -> dict[str, dict[str, Comparison] | IsolationFailure]:
    """Each node computed on the target from the reference's inputs, compared per output.

    Nodes are batched into isolation models of at most ``budget`` bytes of inputs plus outputs.
    A batch the target cannot run is split in halves until the failing nodes stand alone.
    """
    todo = [
        n
        for n in (loaded.nodes if nodes is None else nodes)
        if n.outputs and _reference_known(n, loaded, feeds, store)
    ]
    sizes: dict[str, int | None] = {}
    for n in todo:
        cost = sum(store.nbytes(t) for t in (*n.inputs, *n.outputs) if t in store)
        sizes[n.name] = cost
    # Bodies read outer-scope names directly, so such nodes go alone (see isolation_model).
    batches: list[list[NodeInfo]] = []
    plain = [n for n in todo if not n.implicit_inputs]
    by_name = {n.name: n for n in plain}
    for chunk in plan_chunks([n.name for n in plain], sizes, budget):
        batches.append([by_name[c] for c in chunk])
    batches += [[n] for n in todo if n.implicit_inputs]
    results: dict[str, dict[str, Comparison] | IsolationFailure] = {}
    pending = list(reversed(batches))
    while pending:
        batch = pending.pop()
        try:
            outs = _run_isolated(target, loaded, feeds, store, batch, stats)
        except BackendError as exc:
            if len(batch) == 1:
                results[batch[0].name] = IsolationFailure(str(exc), isinstance(exc, BackendCrash))
                continue
            half = len(batch) // 2
            pending += [batch[half:], batch[:half]]
            continue
        for n in batch:
            results[n.name] = {
                t: compare_tensors(t, store.get(t), outs.get(t), crit) for t in n.outputs
            }
    return results


def _reference_known(node: NodeInfo, loaded: LoadedModel, feeds: Feeds, store: TensorStore) -> bool:
    """Whether the reference's values of every input and output are at hand (a dumped
    reference may hold only some tensors)."""
    known = set(loaded.initializers) | set(feeds) | {""}
    return all(t in known or t in store for t in node.inputs) and all(
        o in store for o in node.outputs
    )


def _run_isolated(
    target: Backend,
    loaded: LoadedModel,
    feeds: Feeds,
    store: TensorStore,
    batch: Sequence[NodeInfo],
    stats: RunStats,
) -> dict[str, npt.NDArray[Any]]:
    needed = [t for n in batch for t in n.inputs]
    metas, constants = reference_operands(loaded, store, needed)
    model, fed = isolation_model(loaded, batch, metas, constants)
    iso_feeds = dict(feeds)
    iso_feeds.update({name: loaded.as_fed(t, store.get(t)) for name, t in fed.items()})
    return timed_run(target, model, iso_feeds, "target", stats)


# Integer tensors this small are shapes, axes and indices: values the graph treats as constants.
_SMALL_INT = 64


def reference_operands(
    loaded: LoadedModel, store: TensorStore, needed: Sequence[str]
) -> tuple[dict[str, TensorMeta], dict[str, npt.NDArray[Any]]]:
    """Types for the fed reference tensors, and the values to embed as constants, both in the
    model's own dtypes (a float64 reference must still feed a float32 kernel)."""
    metas = {t: loaded.fed_meta(t, m) for t, m in store.metas.items()}
    constants = {t: loaded.as_fed(t, store.get(t)) for t in needed if is_constant(t, loaded, store)}
    return metas, constants


def is_constant(tensor: str, loaded: LoadedModel, store: TensorStore) -> bool:
    if tensor not in store:
        return False
    producer = loaded.producer.get(tensor)
    if producer is not None and producer.op_type == "Constant":
        return True
    meta = store.meta(tensor)
    small = int(np.prod(meta.shape, dtype=np.int64)) <= _SMALL_INT
    return small and not np.issubdtype(meta.dtype, np.floating)


def judge(
    loaded: LoadedModel,
    accumulated: Mapping[str, Comparison],
    isolated: Mapping[str, dict[str, Comparison] | IsolationFailure],
    crit: Criterion,
) -> list[NodeResult]:
    """Per-node verdicts from the accumulated and isolated comparisons."""
    results: list[NodeResult] = []
    for n in loaded.nodes:
        acc = _worst([accumulated[t] for t in n.outputs if t in accumulated], crit)
        iso_entry = isolated.get(n.name)
        iso: Comparison | None = None
        note = ""
        if isinstance(iso_entry, IsolationFailure):
            if iso_entry.crashed:
                verdict = Verdict.CRASHED
            else:
                verdict = Verdict.UNSUPPORTED if iso_entry.unsupported else Verdict.FAILED
            note = f"target could not run this node alone: {iso_entry.message}"
        else:
            iso = _worst(list(iso_entry.values()), crit) if iso_entry else None
            if iso is not None and iso.diverged:
                verdict = Verdict.CULPRIT
            elif acc is not None and acc.diverged:
                verdict = Verdict.PROPAGATED
            elif acc is None and iso is None:
                verdict = Verdict.NOT_PROBED
            else:
                verdict = Verdict.OK
        results.append(
            NodeResult(
                index=n.index,
                name=n.name,
                op_type=n.op_type,
                inputs=n.inputs,
                outputs=n.outputs,
                verdict=verdict,
                accumulated=acc,
                isolated=iso,
                amplification=_amplification(n, acc, accumulated),
                note=note,
            )
        )
    return results


def _worst(comparisons: Sequence[Comparison], crit: Criterion) -> Comparison | None:
    if not comparisons:
        return None
    return max(comparisons, key=crit.badness)


def _amplification(
    node: NodeInfo, acc: Comparison | None, accumulated: Mapping[str, Comparison]
) -> float | None:
    """Output error ÷ worst input error, both as rel_l2: how much this node grows the error."""
    if acc is None or "rel_l2" not in acc.metrics:
        return None
    ins = [accumulated[t].metrics.get("rel_l2", 0.0) for t in node.inputs if t in accumulated]
    worst_in = max((x for x in ins if x == x), default=0.0)
    out = acc.metrics["rel_l2"]
    if worst_in <= 0.0 or out != out:
        return None
    return out / worst_in


def first_divergence(nodes: Sequence[NodeResult]) -> NodeResult | None:
    return next((n for n in nodes if n.diverged), None)


def culprit_cause(node: NodeResult) -> RootCause:
    iso = node.isolated
    why = (iso.reason or iso.status.value) if iso is not None else "isolated"
    return RootCause(
        "culprit",
        (node.name,),
        f"{node.op_type} {node.name!r} diverges on its own when fed the reference's inputs ({why})",
    )


def root_cause(nodes: Sequence[NodeResult], first: NodeResult | None) -> RootCause | None:
    """The earliest culprit; when no node is wrong on its own, say so plainly."""
    culprit = next((n for n in nodes if n.verdict is Verdict.CULPRIT), None)
    if culprit is not None and culprit.isolated is not None:
        return culprit_cause(culprit)
    if first is None:
        return RootCause(
            "none",
            (),
            "the final outputs diverge but no probed tensor does: marking intermediates as "
            "outputs changes the target's result (a fusion is likely involved)",
        )
    failed = [n.name for n in nodes if n.verdict in (Verdict.UNSUPPORTED, Verdict.FAILED)]
    extra = f"; the target could not run {', '.join(failed[:3])} alone" if failed else ""
    return RootCause(
        "none",
        (),
        "no single node diverges when fed the reference's inputs: the error comes from a "
        "pattern of nodes or from accumulated rounding" + extra,
    )
