#!/usr/bin/env python3
"""A simulated ML compiler for the exec: protocol: a compile per distinct model, then
examples/faulty_runtime.py.

    python tests/compiler_runtime.py MODEL INPUTS OUTPUTS --log FILE [--compile-s S]
        [--illegal NODE] [--declare] [FAULTY OPTIONS...]

Each run appends the model's hash (SHA-256 of the model file) and node count to ``--log``
FILE. A model whose hash is not in FILE yet is "compiled": the run sleeps ``--compile-s``
seconds (a model seen before costs nothing, as with a compiler's own cache), so the wall time
counts distinct models and FILE tells runs from compiles. With ``--illegal NODE`` the compile
fails (exit 1) whenever NODE is in the model, with IREE's words for an op it cannot lower
("failed to legalize operation"). With ``--declare`` every run says on stderr that it compiles
(``onnx-bisect-capability: compiles``, docs/exec-protocol.md). Every other option goes to
examples/faulty_runtime.py, which then runs the model with ONNX Runtime.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
import time
from pathlib import Path

import onnx

_FAULTY = Path(__file__).resolve().parents[1] / "examples" / "faulty_runtime.py"


def _flag(argv: list[str], flag: str) -> tuple[bool, list[str]]:
    return flag in argv, [a for a in argv if a != flag]


def _take(argv: list[str], flag: str) -> tuple[str | None, list[str]]:
    if flag not in argv:
        return None, argv
    i = argv.index(flag)
    return argv[i + 1], argv[:i] + argv[i + 2 :]


def main(argv: list[str]) -> int:
    log, argv = _take(argv, "--log")
    seconds, argv = _take(argv, "--compile-s")
    illegal, argv = _take(argv, "--illegal")
    declare, argv = _flag(argv, "--declare")
    if declare:
        print("onnx-bisect-capability: compiles", file=sys.stderr)
    assert log is not None, "--log FILE is required"
    digest = hashlib.sha256(Path(argv[0]).read_bytes()).hexdigest()
    model = onnx.load(argv[0], load_external_data=False)
    path = Path(log)
    seen = path.read_text().split() if path.exists() else []
    with path.open("a") as f:
        f.write(f"{digest} {len(model.graph.node)}\n")
    if digest not in seen:
        time.sleep(float(seconds or 0))
    for node in model.graph.node:
        if node.name == illegal:
            print(
                "error: failed to legalize operation 'torch.operator' that was explicitly "
                f'marked illegal: {{name = "{node.name}"}} onnx.{node.op_type}',
                file=sys.stderr,
            )
            return 1
    spec = importlib.util.spec_from_file_location("faulty_runtime", _FAULTY)
    assert spec and spec.loader
    faulty = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(faulty)
    code: int = faulty.main(argv)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
