"""The memory plan: how ``--max-memory`` is shared by what a diagnosis holds at once.

The budget covers the tensors: what the tool keeps for the whole diagnosis (the inputs, the
final outputs, reference values kept in memory), the probe outputs of the runs in flight, each
runtime's working set while it runs (in-process or in a child process), isolation feeds, and
the values being compared. It does not cover the fixed overhead (the interpreter and its
libraries, each child runtime's own start-up, comparisons' float64 blocks), nor the model's
weights; benchmarks/bench_memory.py measures what that adds up to. One runtime's copy of the
weights is a cost no plan avoids; a second at the same time is a choice, so whether the
reference and the target run side by side counts both copies against the budget.

Every figure is computed from shape inference before any run, so the split is known, and a
budget too small for one run is an error, before any work.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from onnx_bisect.errors import InputError
from onnx_bisect.graph.sizes import model_bytes
from onnx_bisect.graph.view import LoadedModel

__all__ = ["FIXED_OVERHEAD", "KEEP_FRACTION", "MemoryPlan", "plan_memory", "working_set"]

# What the budget does not cover, as measured by benchmarks/bench_memory.py (the target it
# checks): the interpreter and libraries (torch for the float64 oracle), each child runtime's
# start-up, comparisons' float64 blocks, and the allocator's slack.
FIXED_OVERHEAD = 600 << 20

# Reference values are kept in memory, rather than on disk and memory-mapped back, when all of
# them take at most this share of the budget: then every probe also fits one run.
KEEP_FRACTION = 8


@dataclass(frozen=True)
class MemoryPlan:
    """The budget's split for one session; all figures in bytes at the model's own dtypes.

    ``largest``: the largest probe (``name``). ``working``: what a runtime holds while it runs
    the plain model (``working_set``). ``held``: what the tool keeps for the whole diagnosis.
    ``compare``: the reference values being compared with one tensor (the reference's and the
    float64 oracle's, memory-mapped in). ``weights``: the model's weights, which a runtime holds
    while it runs (ONNX Runtime a packed copy of them: 1.06x on a 2 GB Llama)."""

    budget: int
    largest: int
    name: str
    working: int
    probes: int
    held: int
    compare: int
    weights: int = 0

    @property
    def free(self) -> int:
        """What runs may use: the budget less what is held and what a comparison maps in."""
        return self.budget - self.held - self.compare

    def keeps(self, factor: int = 1) -> bool:
        """Whether a store of ``factor`` × every probe stays in memory (it is then in
        ``held``) instead of going to disk."""
        return factor * self.probes * KEEP_FRACTION <= self.budget

    def chunk(self, *, runtimes: int = 1, factor: int = 1, beside: int = 0) -> int:
        """Probe-output bytes one run may mark while ``runtimes`` such runs are in flight, each
        computing in ``factor`` × the model's bytes (2: a float64 oracle), beside ``beside``
        plain runs of other runtimes. Each run holds its outputs and its working set."""
        room = (self.free - beside * self.working) // runtimes
        return (room - factor * self.working) // factor

    @property
    def side_by_side(self) -> bool:
        """Whether the reference and the target may run the plain model at the same time:
        each holds the weights and its working set. Otherwise they take turns (a 2 GB
        model's two copies of its weights would be most of the process tree's peak)."""
        return 2 * (self.weights + self.working) <= self.free

    @property
    def pair_chunk(self) -> int:
        """Probe-output bytes each of the reference's and the target's runs may mark when
        they run at the same time: each holds the weights beside its chunk."""
        return self.chunk(runtimes=2) - self.weights

    @property
    def pair(self) -> bool:
        """Whether the reference and the target can run a chunk each at the same time."""
        return self.side_by_side and self.pair_chunk >= self.largest

    def oracle_beside(self, parallel: bool) -> int:
        """Plain runs the float64 oracle leaves room for: both of the screen's when it runs
        alongside them, which it does (with ``parallel``) only when that does not split it
        into more runs than alone: every probe in one run beside them. Otherwise it runs
        first, and alone."""
        fits = self.chunk(factor=2, beside=2) >= self.probes
        return 2 if parallel and fits else 0

    @property
    def isolation(self) -> int:
        """Inputs plus outputs of one isolation batch: the tool holds its feeds while the
        runtime holds them too (a child reads its own copy) and computes the outputs."""
        return self.free // 2

    def require(self, *, factor: int = 1, option: str = "max_memory") -> None:
        """Fail, naming the least budget that works, unless one run of ``factor`` × the
        model's bytes (2: the float64 oracle's) can mark the largest probe."""
        if self.chunk(factor=factor) >= self.largest:
            return
        kept = self.held + self.compare
        need = kept + factor * (self.largest + self.working)
        text = (
            f"{option} {self.budget} cannot hold the largest tensor, {self.name!r} "
            f"({self.largest} bytes), beside a runtime's working set ({self.working} bytes) "
            f"and what the diagnosis keeps ({kept} bytes)"
        )
        if factor == 2:
            text += " in float64"
        text += f"; give at least {need} ({_rounded_up(need)})"
        if factor == 2:
            alone = kept - 2 * self.largest + self.largest + self.working
            text += f", or {alone} with a fixed threshold (no float64 oracle)"
        raise InputError(text, option=option)


def _rounded_up(size: int) -> str:
    """``size`` in KB or MB (binary, as the CLI reads them) to a tenth, rounded up."""
    unit, name = (1 << 20, "MB") if size >= 1 << 20 else (1 << 10, "KB")
    tenths = -(-size * 10 // unit)
    return f"{tenths // 10}.{tenths % 10}{name}" if tenths % 10 else f"{tenths // 10}{name}"


def working_set(loaded: LoadedModel, sizes: Mapping[str, int | None], fallback: int) -> int:
    """Peak bytes of the tensors alive at once in a plain run in graph order: every node's
    inputs that a later node still reads, and its outputs. A runtime's own plan may do better
    (in-place kernels) or a little worse; weights are not counted (see the module's doc)."""
    last: dict[str, int] = {}
    for i, node in enumerate(loaded.nodes):
        for t in (*node.inputs, *node.implicit_inputs):
            last[t] = i
    weights, kept = loaded.initializers, set(loaded.outputs) | set(loaded.inputs)

    def size(t: str) -> int:
        known = sizes.get(t)
        return fallback if known is None else known

    live = sum(size(t) for t in loaded.inputs if t not in weights)
    peak = live
    for i, node in enumerate(loaded.nodes):
        live += sum(size(o) for o in node.outputs if o)
        peak = max(peak, live)
        dead = {t for t in (*node.inputs, *node.implicit_inputs) if last.get(t) == i}
        dead |= {o for o in node.outputs if o and o not in last}
        live -= sum(size(t) for t in dead - kept if t and t not in weights)
    return peak


def plan_memory(
    loaded: LoadedModel,
    sizes: Mapping[str, int | None],
    budget: int,
    *,
    float64: bool,
    feeds: int,
) -> MemoryPlan:
    """The split of ``budget`` for ``loaded`` at these ``sizes`` (``float64``: the oracle's
    store exists; ``feeds``: bytes of the inputs)."""
    probes = _probe_sizes(loaded.probes, sizes)
    name = max(probes, key=probes.__getitem__, default="")  # the first of the largest
    largest = probes.get(name, 0)
    total = sum(probes.values())
    outputs = sum(probes.get(t, 0) for t in loaded.outputs)
    plan = MemoryPlan(budget, largest, name, working_set(loaded, sizes, largest), total, 0, 0)
    # The inputs, and three copies of the final outputs: the screen's of both backends (for
    # task checks) and the scan's of the target (to see whether marking changed them).
    held = feeds + 3 * outputs
    held += total if plan.keeps() else 0
    held += 2 * total if float64 and plan.keeps(2) else 0
    # A comparison maps in the reference's value of one tensor and the oracle's (float64).
    compare = 3 * largest if float64 else largest
    weights = model_bytes(loaded.model).weights
    return MemoryPlan(budget, largest, name, plan.working, total, held, compare, weights)


def _probe_sizes(names: Sequence[str], sizes: Mapping[str, int | None]) -> dict[str, int]:
    """Bytes of every probe; one of unknown size counts as the largest known."""
    known = [s for s in sizes.values() if s is not None]
    fallback = max(known, default=0)
    return {n: fallback if (s := sizes.get(n)) is None else s for n in names}
