"""The child side of ``WorkerBackend``: ``python -m onnx_bisect.backends.serve SPEC``.

It builds the backend of SPEC at once (so that the runtime's import overlaps the parent's own
work), then answers requests until its stdin closes: one JSON line in (``model``, ``inputs``,
``outputs``: paths in the worker's folder), one JSON line out (``ok`` with the notes the
runtime added since the last answer, or ``error`` with the error's class, message and
detail). A segfault, an abort or a Rust panic ends this process; the parent sees its pipe
close and reports a ``BackendCrash``.

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

import numpy as np

from onnx_bisect.backends.protocol import Backend, BackendBase, one_line
from onnx_bisect.backends.registry import create_backend
from onnx_bisect.backends.spec import parse_spec
from onnx_bisect.errors import BackendError, OnnxBisectError
from onnx_bisect.graph.weights import read_model
from onnx_bisect.inputs.feeds import save_npz

__all__ = ["main"]


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m onnx_bisect.backends.serve SPEC", file=sys.stderr)
        return 2
    answers = _answers()
    try:
        backend: Backend | OnnxBisectError = create_backend(parse_spec(argv[0]))
    except OnnxBisectError as exc:  # said at the first request, where the parent listens
        backend = exc
    seen: Counter[str] = Counter()
    for line in sys.stdin:
        job = json.loads(line)
        answer = _serve(backend, job) if not isinstance(backend, Exception) else _error(backend)
        if isinstance(backend, BackendBase):
            answer["notes"], answer["facts"] = _new_notes(backend, seen)
        answers.write(json.dumps(answer) + "\n")
        answers.flush()
    return 0


def _answers() -> TextIO:
    """The answers' own copy of stdout; file descriptor 1 then writes to stderr."""
    answers = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    return answers


def _serve(backend: Backend, job: dict[str, str]) -> dict[str, Any]:
    try:
        # The weights stay in the user's files, located absolutely, as in the parent.
        model = read_model(Path(job["model"]), own=True)
        with np.load(job["inputs"], allow_pickle=False) as z:
            feeds = {k: z[k] for k in z.files}
        save_npz(Path(job["outputs"]), backend.run(model, feeds))
    except OnnxBisectError as exc:
        return _error(exc)
    except Exception as exc:  # a plugin that raises its own types: the runtime failed
        return _error(BackendError(f"{backend.spec.text}: {one_line(exc)}", detail=str(exc)))
    return {"ok": True}


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
