"""The child side of a transform: ``python -m onnx_bisect.transforms.child IN OUT_DIR
TRANSFORM SHAPES_JSON``. Kept out of the package's imports so that ``-m`` runs it fresh."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

import onnx

from onnx_bisect.errors import SpecError
from onnx_bisect.graph.save import save_model
from onnx_bisect.graph.weights import read_model, with_loaded_weights
from onnx_bisect.transforms.registry import EXIT_FAILED, EXIT_SPEC, parse_transform, transform_kinds
from onnx_bisect.transforms.validity import broken_by, unchecked

__all__ = ["main"]


def main(argv: Sequence[str]) -> int:
    """Writes OUT_DIR/model.onnx and OUT_DIR/notes.json; the last stderr line says why not."""
    src, out, text, shapes = argv
    try:
        parsed = parse_transform(text)
        kind = transform_kinds()[parsed.name]
        # The weights stay on disk until the transform needs them, so that what onnx must
        # serialize (shape inference, the optimizers' C++ cores) stays small past 2 GB.
        located = read_model(Path(src), own=True)
        model = located
        if kind.infer_shapes:
            model = onnx.shape_inference.infer_shapes(located)
        if kind.reads_weights:
            model = with_loaded_weights(model)
        result, notes = kind.apply(model, parsed.arg, json.loads(shapes))
        problem = broken_by(located, result) or unchecked(located, result)
        if problem:
            print(f"{kind.package} wrote an invalid model: {problem[:240]}", file=sys.stderr)
            return EXIT_FAILED
        save_model(result, Path(out))
        (Path(out) / "notes.json").write_text(json.dumps(list(notes)))
    except SpecError as exc:
        print(exc, file=sys.stderr)
        return EXIT_SPEC
    except Exception as exc:
        print(" ".join(str(exc).split())[:300] or type(exc).__name__, file=sys.stderr)
        return EXIT_FAILED
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
