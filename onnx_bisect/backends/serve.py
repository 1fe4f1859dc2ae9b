"""The child side of ``WorkerBackend``: ``python -m onnx_bisect.backends.serve SPEC``.

It builds the backend of SPEC at once (so that the runtime's import overlaps the parent's own
work), then answers requests until its stdin closes: one JSON line in (``spec``: SPEC or a
sibling's, built at its first request; ``model``, ``inputs`` and ``outputs``: paths in the
worker's folder; ``index``: the inputs' layout, ``handover.py``), one JSON line out (``ok``
with the outputs' ``index`` and the notes the runtime added since the last answer, or
``error`` with the error's class, message and detail). A segfault, an abort or a Rust panic
ends this process; the parent sees its pipe close and reports a ``BackendCrash``.

Its own stdout is kept for the answers: file descriptor 1 is pointed at stderr, so that what
a runtime prints (from C, where Python cannot catch it) never lands inside an answer.
Kept out of the package's imports so that ``-m`` runs it fresh.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any, TextIO

from onnx_bisect.backends.handover import read_arrays, write_arrays
from onnx_bisect.backends.protocol import Backend, BackendBase, one_line
from onnx_bisect.backends.registry import create_backend
from onnx_bisect.backends.spec import parse_spec
from onnx_bisect.errors import BackendError, OnnxBisectError
from onnx_bisect.graph.weights import read_model

__all__ = ["main"]


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m onnx_bisect.backends.serve SPEC", file=sys.stderr)
        return 2
    answers = _answers()
    backends = {argv[0]: _built(argv[0])}
    seen: dict[str, Counter[str]] = {}
    for line in sys.stdin:
        job = json.loads(line)
        spec = job.get("spec", argv[0])
        if spec not in backends:  # a sibling's spec (the fp32 workaround), built once
            backends[spec] = _built(spec)
        backend = backends[spec]
        answer = _serve(backend, job) if not isinstance(backend, Exception) else _error(backend)
        if isinstance(backend, BackendBase):
            answer["notes"], answer["facts"] = _new_notes(backend, seen.setdefault(spec, Counter()))
        answers.write(json.dumps(answer) + "\n")
        answers.flush()
    return 0


def _built(spec: str) -> Backend | OnnxBisectError:
    try:
        return create_backend(parse_spec(spec))
    except OnnxBisectError as exc:  # said at the first request, where the parent listens
        return exc


def _answers() -> TextIO:
    """The answers' own copy of stdout; file descriptor 1 then writes to stderr."""
    answers = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    return answers


def _serve(backend: Backend, job: dict[str, Any]) -> dict[str, Any]:
    try:
        # The weights stay in the user's files, located absolutely, as in the parent.
        model = read_model(Path(job["model"]), own=True)
        feeds = read_arrays(Path(job["inputs"]), job["index"])
        index = write_arrays(Path(job["outputs"]), backend.run(model, feeds))
    except OnnxBisectError as exc:
        return _error(exc)
    except Exception as exc:  # a plugin that raises its own types: the runtime failed
        return _error(BackendError(f"{backend.spec.text}: {one_line(exc)}", detail=str(exc)))
    return {"ok": True, "index": index}


def _error(exc: OnnxBisectError) -> dict[str, Any]:
    detail = exc.detail if isinstance(exc, BackendError) else None
    return {"error": type(exc).__name__, "message": str(exc), "detail": detail}


def _new_notes(backend: BackendBase, seen: Counter[str]) -> tuple[dict[str, int], list[str]]:
    """The notes added since the last answer, with their counts (the parent adds them up),
    and which notes are facts (the parent shows those once)."""
    now, facts = backend.note_counts()
    new = {text: n - seen[text] for text, n in now.items() if n > seen[text]}
    seen.update(new)
    return new, sorted(t for t in facts if t in new)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
