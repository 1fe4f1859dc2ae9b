"""The ``Backend`` protocol and ``BackendBase``, which validates and wraps runtime errors."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeGuard, TypeVar, runtime_checkable

import numpy as np
import numpy.typing as npt
import onnx

from onnx_bisect.backends.spec import BackendSpec
from onnx_bisect.compare.precision import PrecisionInfo
from onnx_bisect.errors import BackendError, OnnxBisectError

__all__ = [
    "Backend",
    "BackendBase",
    "Capabilities",
    "Emit",
    "Tensors",
    "computes_in",
    "one_line",
    "streams",
]


Tensors = dict[str, npt.NDArray[Any]]
T = TypeVar("T")
# Takes one computed tensor, by name, as soon as it exists (``BackendBase.stream``).
Emit = Callable[[str, npt.NDArray[Any]], None]


@dataclass(frozen=True)
class Capabilities:
    """What the search may ask of a backend, declared by the backend rather than guessed.

    ``computes``: runs any model it is given. A dump only replays tensors it holds, so the
    search never sends it an isolation, window or prefix model.
    ``partial``: answers only for some tensors; one it does not hold says nothing about the
    tensor (it is left out of the comparison, not counted as missing).
    ``child_process``: every run happens in a child process, so a crash or a timeout comes
    back as ``BackendCrash`` instead of killing the tool.
    ``process_per_run``: each run starts a process of its own (``exec:``,
    ``--isolate-crashes``), so runs may overlap to hide the start (isolation runs two at once).
    ``streams``: ``BackendBase.stream`` hands each wanted tensor over as soon as it is
    computed and then drops it, so one run yields every probe while holding one at a time.
    ``compiles``: every run compiles the model first (an ML compiler: seconds to minutes a
    run), so the searches spend as few runs as they can: the failure search does not check
    its answer one position further, and isolation batches are as large as memory allows.
    """

    computes: bool = True
    partial: bool = False
    child_process: bool = False
    process_per_run: bool = False
    streams: bool = False
    compiles: bool = False


@runtime_checkable
class Backend(Protocol):
    """What the search needs from a runtime. Implement it without inheriting if you like.

    ``run`` executes ``model`` (whose graph outputs are the tensors wanted) on ``feeds`` and
    returns every graph output by name. Raise ``BackendError`` when the runtime fails.
    ``recorded_inputs`` returns the inputs a backend's values were computed from when it did
    not compute them now (a dump), else None: a diagnosis must then use those inputs.
    """

    spec: BackendSpec
    capabilities: Capabilities

    def run(self, model: onnx.ModelProto, feeds: Mapping[str, npt.NDArray[Any]]) -> Tensors: ...

    def describe(self) -> str: ...

    def versions(self) -> dict[str, str]: ...

    def recorded_inputs(self) -> Tensors | None: ...


class BackendBase:
    """Validation and error wrapping around ``_run``, so adapters stay small."""

    spec: BackendSpec
    capabilities: Capabilities = Capabilities()

    def __init__(self, spec: BackendSpec) -> None:
        self.spec = spec
        # Counted by text, so a warning that every run repeats is one line with a count.
        self._notes: Counter[str] = Counter()
        self._facts: set[str] = set()  # notes taken ``once``: shown without a count
        self._notes_lock = threading.Lock()

    def run(self, model: onnx.ModelProto, feeds: Mapping[str, npt.NDArray[Any]]) -> Tensors:
        wanted = [o.name for o in model.graph.output]
        out = self._wrapped(lambda: self._run(model, feeds))
        self._check_all([n for n in wanted if n not in out])
        return {n: np.asarray(out[n]) for n in wanted}

    def stream(
        self, model: onnx.ModelProto, feeds: Mapping[str, npt.NDArray[Any]], emit: Emit
    ) -> None:
        """Each graph output of ``model`` handed to ``emit`` as soon as it is computed, and
        dropped by the backend then; only where ``capabilities.streams``."""
        seen: set[str] = set()

        def take(name: str, value: npt.NDArray[Any]) -> None:
            seen.add(name)
            emit(name, np.asarray(value))

        self._wrapped(lambda: self._stream(model, feeds, take))
        self._check_all([o.name for o in model.graph.output if o.name not in seen])

    def _wrapped(self, call: Callable[[], T]) -> T:
        try:
            return call()
        except OnnxBisectError:
            raise
        except Exception as exc:
            # Runtimes raise their own types; the message is what the user needs.
            raise BackendError(
                f"{self.spec.text}: {one_line(exc)}", detail=f"{self.spec.text}: {exc}"
            ) from exc

    def _check_all(self, missing: list[str]) -> None:
        if missing:
            raise BackendError(
                f"{self.spec.text}: did not return output(s) {', '.join(missing[:5])}"
                + (" ..." if len(missing) > 5 else "")
            )

    def _run(self, model: onnx.ModelProto, feeds: Mapping[str, npt.NDArray[Any]]) -> Tensors:
        raise NotImplementedError

    def _stream(
        self, model: onnx.ModelProto, feeds: Mapping[str, npt.NDArray[Any]], emit: Emit
    ) -> None:
        raise NotImplementedError

    def describe(self) -> str:
        return self.spec.text

    def versions(self) -> dict[str, str]:
        return {}

    def computes_in(self) -> PrecisionInfo | None:
        """What this runtime computes float32 work in, where it knows (a ``dtype=`` it was
        given, the precision it picked); None where it says nothing (taken as the model's
        own types)."""
        return None

    def recorded_inputs(self) -> Tensors | None:
        return None

    def notes(self) -> list[str]:
        """What happened during runs that the report should say, one line each in the order
        first seen: a copy run at a lowered IR version, floating-point warnings (which would
        otherwise go to stderr). Empty by default."""
        with self._notes_lock:
            counted = list(self._notes.items())
        return [text if n == 1 else f"{text} ({n} times)" for text, n in counted]

    def note_counts(self) -> tuple[dict[str, int], frozenset[str]]:
        """Every note's count so far, and which of them are facts (taken ``once``): what a
        worker process hands its parent, which adds them to its own (``backends/worker.py``)."""
        with self._notes_lock:
            return dict(self._notes), frozenset(self._facts)

    def _note(self, text: str, count: int = 1, *, once: bool = False) -> None:
        """Record ``text``; ``once`` for a fact (shown without a count), not an event."""
        with self._notes_lock:
            if once:
                self._facts.add(text)
            if not (once and text in self._notes):
                self._notes[text] += count


def computes_in(backend: Backend) -> PrecisionInfo | None:
    """What ``backend`` says it computes in (``BackendBase.computes_in``), else None."""
    return backend.computes_in() if isinstance(backend, BackendBase) else None


def streams(backend: Backend) -> TypeGuard[BackendBase]:
    """Whether ``backend`` declares, and has, ``stream``."""
    return isinstance(backend, BackendBase) and backend.capabilities.streams


def one_line(exc: BaseException, limit: int = 400) -> str:
    """The message on one line, its middle cut where too long: runtimes put the summary last
    (OpenVINO's "Summary: Conversion is failed for: ...")."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    if len(text) <= limit:
        return text
    head = limit // 3
    return f"{text[:head]} … {text[-(limit - head - 3) :]}"
