"""Minimal repro bundles: the smallest subgraph that still diverges, written as an ONNX backend
test case with a standalone ``repro.py``, and proven by running it before we say so.

Candidates come smallest first from ``engine/subgraphs.py`` (the root cause, windows around
it, ranges of its ancestors, the whole prefix). Each is run on the target fed the reference's
tensors at its cut; the first that reproduces is trimmed to the outputs that diverge, written,
and re-run in a fresh process exactly as ``repro.py`` would run it. A bundle that does not
reproduce there makes way for the next candidate; if none does, the report says so.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
from onnx import numpy_helper

from onnx_bisect.backends.compiled import COMPILED_DIR_ENV, compiles_here
from onnx_bisect.backends.protocol import Backend
from onnx_bisect.compare.criterion import Criterion
from onnx_bisect.engine.measure.runs import timed_run
from onnx_bisect.engine.measure.store import TensorStore
from onnx_bisect.engine.session import Session
from onnx_bisect.engine.subgraphs import Candidate, Fed, candidates, reference_window
from onnx_bisect.errors import BackendCrash, BackendError
from onnx_bisect.graph.extract import live_tensors, prefix_model, window_exits
from onnx_bisect.graph.save import save_portable
from onnx_bisect.graph.view import LoadedModel
from onnx_bisect.repro.script import render_repro_script
from onnx_bisect.repro.verify import (
    diverged_outputs,
    load_bundle,
    output_tail,
    rerun_in_process,
    run_bundle,
)
from onnx_bisect.result import ReproInfo
from onnx_bisect.text import plural

__all__ = [
    "BUNDLE_FILES",
    "DATA_DIR",
    "BundleJob",
    "build_bundle",
    "finish_model",
    "write_files",
    "write_repro",
]

# The test case's tensors, as ONNX backend tests lay them out.
DATA_DIR = "test_data_set_0"
# What a bundle directory holds (README.md and issue.md come from report/files.py): what
# ``reduce --out DIR`` replaces in DIR on a rerun.
BUNDLE_FILES = ("model.onnx", "model.onnx.data", "repro.py", DATA_DIR, "README.md", "issue.md")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BundleJob:
    """What a bundle is cut from: the session, the model the target ran, the reference's
    values under that model's names, and the symptom to reproduce."""

    session: Session
    loaded: LoadedModel
    store: TensorStore
    # What the bundle must show: "divergence", "crash" (the target dies) or "error" (the
    # target reports an error, e.g. a missing kernel).
    symptom: str = "divergence"
    # Nodes the target already failed on alone, fed the reference's inputs (``Found``).
    failed_alone: tuple[str, ...] = ()
    # Nodes the target ran alone though every prefix holding them fails (``Found``).
    ran_alone: tuple[str, ...] = ()
    # Tensors no candidate marks as an output (``Found.unmarked``: a crash needs them unseen).
    unmarked: tuple[str, ...] = ()

    @property
    def target(self) -> Backend:
        return self.session.target


def write_repro(
    job: BundleJob, start: Sequence[str], out_dir: Path, *, verify_in_process: bool
) -> ReproInfo:
    """The bundle around the nodes ``start``, with a ``repro.py`` that names this session's
    backends and criterion."""
    if not job.target.capabilities.computes:
        return ReproInfo(
            str(out_dir), job.symptom, (), len(job.loaded.nodes), 0, False, False,
            f"the target {job.target.spec.text} replays recorded tensors and cannot run a "
            "subgraph; no bundle was written (run bisect against the live target for one)",
        )  # fmt: skip
    crit = job.session.crit
    threshold = crit.threshold
    if crit.auto:
        # repro.py has no float64 reference: freeze the noise-floor threshold of the root node.
        node = next((n for n in job.loaded.nodes if n.name in start), None)
        outs = node.outputs if node else ()
        floors = [crit.threshold_for(t, job.store.get(t))[0] for t in outs if t in job.store]
        threshold = min(floors, default=crit.eps)
    precision = None
    if crit.floors is not None:
        # A declared lower precision: the bundle judges with its bound and its range test, so
        # that a correct runtime of that precision does not reproduce it.
        precision = crit.floors.precision.value
        bounds = [b[0] for t in _start_outputs(job, start) if (b := _bound(crit, t)) is not None]
        threshold = max([threshold, *bounds])
    script = render_repro_script(
        ref=_recorded_spec(job.session.ref),
        target=job.target.spec.text,
        metric=crit.metric,
        threshold=threshold,
        atol=crit.atol,
        rtol=crit.rtol,
        title=f"{job.target.spec.text} vs {job.session.ref.spec.text}",
        symptom=job.symptom,
        workdir=os.getcwd(),
        precision=precision,
    )
    return build_bundle(job, start, out_dir, script, verify_in_process=verify_in_process)


def _start_outputs(job: BundleJob, start: Sequence[str]) -> list[str]:
    return [t for n in job.loaded.nodes if n.name in start for t in n.outputs]


def _bound(crit: Criterion, tensor: str) -> tuple[float, float] | None:
    """The precision's bound for ``tensor`` fed the reference's values (its isolated floor)."""
    return crit.for_isolation().precision_limit(tensor)


def _recorded_spec(backend: Backend) -> str:
    """The spec repro.py records for the reference. A dump's values at the bundle's outputs
    are the bundle's expected outputs, so it reads them there, relative to itself, rather than
    from a dump directory that does not travel with the bundle."""
    return f"dump:{DATA_DIR}" if backend.spec.name == "dump" else backend.spec.text


def build_bundle(
    job: BundleJob, start: Sequence[str], out_dir: Path, script: str, *, verify_in_process: bool
) -> ReproInfo:
    """Find, write and verify the smallest reproducing bundle around the nodes ``start``.

    ``verify_in_process``: the target was given as an object a fresh process cannot rebuild,
    so the written bundle is read back and re-run here instead of by ``repro.py``.

    A target whose runs compile (``Capabilities.compiles``) compiles each candidate once. One
    whose every run is in a child process (an exec: compiler; IREE and TVM in their worker,
    the default), or that is checked here, runs it only in the check: a run here and then the
    check's would compile it twice. One that
    runs here and is checked by repro.py (IREE, TVM) runs it here, where a small model
    compiles in a second, and repro.py reads back what was compiled (``_shared_compiles``);
    each check of its own would pay a process start and the compiler's import (about 8 s for
    TVM). Either way the bundle keeps every output of the candidate: trimmed, it would be
    another model to compile.
    """
    caps = job.target.capabilities
    # Checked here (an object no repro.py can rebuild), the check is a run here anyway.
    check_only = caps.compiles and (caps.child_process or verify_in_process)
    with _shared_compiles(job, check_only) as compiled:
        return _search(job, start, out_dir, script, verify_in_process, check_only, compiled)


@contextmanager
def _shared_compiles(job: BundleJob, check_only: bool) -> Iterator[Path | None]:
    """For a compiler that runs in this process and is checked by repro.py, a folder for the
    model each check runs, compiled here already (see ``_check``); None for any other."""
    if not job.target.capabilities.compiles or check_only:
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="onnx-bisect-compiled-") as folder:
        yield Path(folder)


@contextmanager
def _compiled_env(folder: Path) -> Iterator[None]:
    """``folder`` named in ``COMPILED_DIR_ENV``, for this process's compile cache and the
    repro.py it starts (which inherits the environment); the bundle stage runs alone, so no
    other thread compiles meanwhile."""
    before = os.environ.get(COMPILED_DIR_ENV)
    os.environ[COMPILED_DIR_ENV] = str(folder)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(COMPILED_DIR_ENV, None)
        else:
            os.environ[COMPILED_DIR_ENV] = before


def _search(
    job: BundleJob,
    start: Sequence[str],
    out_dir: Path,
    script: str,
    verify_in_process: bool,
    check_only: bool,
    compiled: Path | None,
) -> ReproInfo:
    loaded, stats = job.loaded, job.session.stats
    kind = job.symptom
    runs_before = stats.runs.get("target", 0)
    tried = 0  # candidates checked, for a compiler each one compile
    last_written: tuple[Candidate, str] | None = None
    for cand in _candidates(job, start):
        if not _can_reproduce(job, cand):
            continue
        built = _build(job, cand, None) if check_only else _reproduce(job, cand)
        if built is None:
            continue
        write_files(out_dir, built, script)
        ok, tail, verify_in_process = _check(
            job, out_dir, in_process=verify_in_process, compiled=compiled
        )
        tried += 1
        runs = stats.runs.get("target", 0) - runs_before + (tried - 1 if check_only else 0)
        names = tuple(n.name for n in cand.nodes)
        last_written = (cand, tail)
        if ok:
            shown = ", ".join(names[:4]) + (" …" if len(names) > 4 else "")
            # How the bundle was found, in words: "(1 target run to minimize)" was cryptic.
            shrunk = (
                f"shrunk from {plural(len(loaded.nodes), 'node')} in {plural(runs, 'target run')}"
                if runs or names != job.failed_alone
                else "the failure search's check of the node alone"
            )
            message = f"{plural(len(names), 'node')}: {shown} ({shrunk})"
            if cand.prefix:
                message = (
                    f"does not reproduce in isolation, smallest reproducing subgraph has "
                    f"{plural(len(names), 'node')} (the graph up to {names[-1]!r}; {shrunk})"
                )
            return ReproInfo(
                str(out_dir), kind, names, len(loaded.nodes), runs, not cand.prefix, True, message
            )
        size = plural(len(names), "node")
        log.debug("a bundle of %s did not reproduce in a fresh process: %s", size, tail)
    runs = stats.runs.get("target", 0) - runs_before + (tried if check_only else 0)
    if last_written is None:
        return ReproInfo(
            str(out_dir), kind, (), len(loaded.nodes), runs, False, False,
            "no subgraph reproduces the divergence when run on its own; no bundle was written",
        )  # fmt: skip
    cand, tail = last_written
    names = tuple(n.name for n in cand.nodes)
    said = (
        f"no subgraph reproduced the {kind} when its bundle was run; the last one written "
        f"({plural(len(names), 'node')}) is not verified: {tail}"
        if check_only
        else f"the last bundle written ({plural(len(names), 'node')}) reproduced in this "
        f"process but not when re-run in a fresh one (nondeterminism?): {tail}"
    )
    return ReproInfo(
        str(out_dir), kind, names, len(loaded.nodes), runs, not cand.prefix, False, said
    )


def _candidates(job: BundleJob, start: Sequence[str]) -> Iterator[Candidate]:
    """``candidates``; where a crash needs tensors unobserved, the last start node with all
    its ancestors, fed the model's inputs, before the whole prefix: the smallest model that
    holds the fusion when the reference's values cannot feed a window (a second model's)."""
    loaded = job.loaded
    for cand in candidates(loaded, job.store, start):
        if cand.prefix and job.unmarked:
            end = cand.nodes[-1].index
            closure = sorted(loaded.ancestors(end) | {end})
            yield Candidate(tuple(loaded.nodes[i] for i in closure), False)
        yield cand


def _check(
    job: BundleJob, out_dir: Path, *, in_process: bool, compiled: Path | None = None
) -> tuple[bool, str, bool]:
    """Run the written bundle as its user would: whether it reproduces, the last lines it
    said, and whether later checks must run here (repro.py could not build the target).
    ``compiled``: the folder of ``_shared_compiles``."""
    stats = job.session.stats
    if not in_process:
        # A hang is checked with the run's --timeout, not repro.py's default (10 min).
        flags = {"--timeout": job.session.options.timeout}
        reused = False
        if compiled is not None and job.symptom in ("divergence", "error"):
            # An error's failed compile is exported as its ``.failed`` file (compiled.py).
            with _compiled_env(compiled):
                before = compiles_here()
                exported = _export(job, out_dir, compiled)
                if compiles_here() > before:  # not the candidate's bytes: a compile after all
                    stats.record_check()
                code, output = run_bundle(out_dir, flags)
            reused = bool(exported) and not set(compiled.iterdir()) - exported
        else:  # a crash's run may not end: the check runs it anew
            code, output = run_bundle(out_dir, flags)
        if code != 2:  # 2: repro.py could not run it (a spec it cannot build, say)
            if reused:
                log.info("the bundle's check read back the model compiled for it")
            else:
                stats.record_check()  # the target ran it once more: for a compiler, a compile
            return code == 1, output_tail(output), False
        if not job.target.capabilities.compiles:
            return False, output_tail(output), False
        # A compiler's candidate has run nowhere yet: it is checked here, and so are the next.
        log.info("repro.py cannot run the target (%s); checking here", output_tail(output))
    ok, tail = rerun_in_process(out_dir, job.target, job.session.crit, job.symptom)
    stats.record_check()
    return ok, tail, True


def _export(job: BundleJob, out_dir: Path, folder: Path) -> set[Path]:
    """Have the compile cache write what it compiled for the written bundle into ``folder``
    (a run of the bundle as read back, which the candidate's run here compiled already: not a
    compile, so not counted), for repro.py to read back; the files there after it. An error's
    compile, failed, is written as its ``.failed`` file. A candidate the bundle search ran is
    the same bytes for the compile cache's key (checked on IREE and TVM); the failure search's
    check of a node alone is not (its input is renamed), so this run compiles it, which the
    caller counts, and repro.py reads that back rather than compile it again."""
    model, inputs, _ = load_bundle(out_dir)
    try:
        job.target.run(model, inputs)
    except BackendError as exc:
        log.debug("the bundle's model could not be exported for its check: %s", exc)
    return set(folder.iterdir())


def _can_reproduce(job: BundleJob, cand: Candidate) -> bool:
    """Whether ``cand`` may show the failure, from what the failure search already ran: where
    the root node ran alone but no prefix holding it runs, the failure needs nodes before it,
    and the prefix that fails holds none of its consumers, so only subgraphs of its ancestors
    are tried (TVM's Reshape of a computed shape: windows with its consumers cost a compile
    each and never failed)."""
    if job.symptom == "divergence" or not job.ran_alone or cand.prefix:
        return True
    index = {n.name: n.index for n in job.loaded.nodes}
    roots = [index[n] for n in job.ran_alone if n in index]
    if not roots:
        return True
    needed = set(roots).union(*(job.loaded.ancestors(r) for r in roots))
    names = {n.name for n in cand.nodes}
    return not names <= set(job.ran_alone) and all(n.index in needed for n in cand.nodes)


def _reproduce(job: BundleJob, cand: Candidate) -> Fed | None:
    """Run a candidate on the target; when it reproduces, the bundle trimmed to what shows it."""
    built = _build(job, cand, None)
    names = tuple(n.name for n in cand.nodes)
    if job.symptom == "error" and not cand.prefix and names == job.failed_alone:
        # The failure search ran this very node alone on the target and it failed: a compile
        # error is the compiler's deterministic answer, so the run is not repeated here; the
        # bundle's check in a fresh process (repro.py) is its one run.
        return built
    try:
        out = timed_run(job.target, built.model, built.inputs, "target", job.session.stats)
    except BackendCrash:
        return built if job.symptom == "crash" else None
    except BackendError as exc:
        if job.symptom == "error":
            return built
        log.debug("candidate failed on the target: %s", exc)
        return None
    if job.symptom != "divergence":
        return None
    bad = diverged_outputs(built.outputs, out, job.session.crit)
    if not bad:
        return None
    if len(bad) < len(built.outputs) and not job.target.capabilities.compiles:
        return _build(job, cand, bad)  # a compiler's bundle is the model it compiled
    return built


def _build(job: BundleJob, cand: Candidate, outputs: Sequence[str] | None) -> Fed:
    loaded, store, feeds = job.loaded, job.store, job.session.feeds
    if not cand.prefix:
        if outputs is None and job.unmarked:
            outputs = _unmarked(job, window_exits(loaded, cand.nodes))
        fed = reference_window(loaded, store, feeds, cand.nodes, outputs)
        return Fed(finish_model(fed.model), fed.inputs, fed.outputs)
    live = _unmarked(job, live_tensors(loaded, len(cand.nodes))) if job.unmarked else None
    model = prefix_model(loaded, len(cand.nodes), store.metas, live)
    if outputs is not None:
        model = _keep_outputs(model, outputs)
    used = {i.name for i in model.graph.input}
    inputs = {k: np.asarray(v) for k, v in feeds.items() if k in used}
    names = [o.name for o in model.graph.output]
    refs = {t: np.asarray(store.get(t)) for t in names if t in store}
    return Fed(finish_model(model), inputs, refs)


def _unmarked(job: BundleJob, names: Sequence[str]) -> list[str] | None:
    """``names`` without the tensors the bundle must leave unobserved; None (the default
    outputs) where nothing would be left."""
    kept = [t for t in names if t not in job.unmarked]
    return kept or None


def _keep_outputs(model: onnx.ModelProto, names: Sequence[str]) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    keep = [o for o in out.graph.output if o.name in set(names)]
    del out.graph.output[:]
    out.graph.output.extend(keep)
    return out


def finish_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """Shape-inferred, with a descriptive graph name, and valid under the full checker."""
    model.graph.name = "onnx_bisect_repro"
    try:
        model = onnx.shape_inference.infer_shapes(model, data_prop=True)
    except Exception as exc:  # a custom op defeats inference; the bundle still runs
        log.debug("shape inference on the bundle failed: %s", exc)
    return model


def write_files(out_dir: Path, built: Fed, script: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    # The weights it uses are copied in (a bundle travels without the model), into
    # model.onnx.data when the model's were external or do not fit one message.
    save_portable(built.model, out_dir)
    data = out_dir / DATA_DIR
    if data.exists():
        for old in data.glob("*.pb"):
            old.unlink()
    data.mkdir(exist_ok=True)
    for i, inp in enumerate(i for i in built.model.graph.input if i.name in built.inputs):
        tensor = numpy_helper.from_array(_contiguous(built.inputs[inp.name]), inp.name)
        (data / f"input_{i}.pb").write_bytes(tensor.SerializeToString())
    for i, out in enumerate(built.model.graph.output):
        if out.name in built.outputs:
            tensor = numpy_helper.from_array(np.asarray(built.outputs[out.name]), out.name)
            (data / f"output_{i}.pb").write_bytes(tensor.SerializeToString())
    (out_dir / "repro.py").write_text(script)


def _contiguous(value: object) -> npt.NDArray[Any]:
    """``value`` as a C-contiguous array of its own shape: ``np.ascontiguousarray`` makes a
    0-d array 1-d, and a bundle whose 0-d input (silero-vad's ``sr``) became (1,) is refused
    by its own repro.py."""
    return np.require(np.asarray(value), requirements="C")
