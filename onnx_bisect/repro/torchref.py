"""The repro bundle of a PyTorch-side run: the ONNX nodes that stand for the culprit module,
fed the module's own captured inputs, with the module's output as the expected output. Its
``repro.py`` reads the expected output as a recorded reference (``dump:test_data_set_0``)
and runs the backend that ran the ONNX model: REPRODUCED where the ONNX nodes there compute
something else than the module (a wrong translation, or that backend's kernel). Verified as
a two-backend bundle is: by ``repro.py`` in a fresh process, or read back and run here for
a backend given as an object."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from onnx_bisect.engine.subgraphs import Fed
from onnx_bisect.engine.torchref.run import BundleRequest
from onnx_bisect.repro.bundle import DATA_DIR, finish_model, write_files
from onnx_bisect.repro.script import render_repro_script
from onnx_bisect.repro.verify import output_tail, rerun_in_process, run_bundle
from onnx_bisect.result import ReproInfo

__all__ = ["torch_repro"]


def torch_repro(request: BundleRequest, out_dir: Path) -> ReproInfo:
    """Write the bundle of ``request`` to ``out_dir`` and check that it reproduces."""
    window, tensor = request.window, request.tensor
    model = finish_model(window.model)
    out = next(o for o in model.graph.output if o.name == tensor)
    dtype = _np_dtype(out.type.tensor_type.elem_type)
    expected = np.asarray(request.expected).astype(dtype, copy=False)
    crit = request.crit
    threshold = crit.threshold
    if crit.auto:
        # repro.py has no float64 reference: the noise-floor threshold of the tensor, frozen.
        threshold = crit.threshold_for(tensor, expected)[0]
    spec = request.spec or request.backend.spec.text
    script = render_repro_script(
        ref=f"dump:{DATA_DIR}",
        target=spec,
        metric=crit.metric,
        threshold=threshold,
        atol=crit.atol,
        rtol=crit.rtol,
        title=f"{spec} vs {request.source} ({request.label}, its output recorded)",
        workdir=os.getcwd(),
    )
    write_files(out_dir, Fed(model, dict(window.feeds), {tensor: expected}), script)
    if request.spec is not None:
        code, said = run_bundle(out_dir)
        ok, tail = code == 1, output_tail(said)
    else:
        ok, tail = rerun_in_process(out_dir, request.backend, crit, "divergence")
    verdict = "reproduces" if ok else "does NOT reproduce"
    message = (
        f"{request.label}: its {len(window.nodes)} ONNX nodes fed the module's captured "
        f"inputs on {spec}, against the module's output: {verdict} ({tail})"
    )
    return ReproInfo(
        str(out_dir), "divergence", window.nodes, request.nodes_before, 0, True, ok, message
    )


def _np_dtype(elem_type: int) -> np.dtype[np.generic]:
    from onnx import helper

    return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type))
