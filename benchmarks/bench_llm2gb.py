#!/usr/bin/env python3
"""Issue 28's acceptance benchmark: the 10,176-node, 2.15 GiB Llama with a 1% fault.

    python benchmarks/bench_llm2gb.py [--dir /tmp/llm2g] [--interval 0.05]

Builds (once, about 45 s; 2.2 GB of disk) ``benchmarks/llm.py``'s Llama with 88 layers,
hidden 768 and MLP 2064, which torch.onnx writes with a file per weight tensor; plants a 1%
fault in ``layers.44/mlp/down_proj/MatMul`` through ``examples/faulty_runtime.py``; and runs
``bisect MODEL --target exec:... --out DIR`` at default settings from another working
directory, sampling the process tree's resident memory (``memtree.measure``). Prints one row:
the exit code, whether the culprit was named, wall seconds, the stage seconds, and the peaks
of the tree and of the tool's own process against the weights. Needs torch and transformers
(the dev extra) to build the model.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
import tempfile
from pathlib import Path

import onnx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.llm import down_proj, llama  # noqa: E402
from benchmarks.memtree import measure  # noqa: E402
from onnx_bisect.graph.load import load_model  # noqa: E402
from onnx_bisect.graph.sizes import model_bytes  # noqa: E402

LAYERS, HIDDEN, INTERMEDIATE, FAULT_LAYER = 88, 768, 2064, 44
GIB = 1 << 30
STAGES = r"float64 ([\d.]+)s, screen ([\d.]+)s, scan ([\d.]+)s, isolate ([\d.]+)s"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "llm2g")
    p.add_argument("--interval", type=float, default=0.05)
    args = p.parse_args()
    path = llama(LAYERS, args.dir / "m.onnx", hidden=HIDDEN, intermediate=INTERMEDIATE)
    node = down_proj(onnx.load(str(path), load_external_data=False), FAULT_LAYER)
    weights = model_bytes(load_model(path).model).weights
    runtime = [sys.executable, str(ROOT / "examples" / "faulty_runtime.py")]
    target = "exec:" + shlex.join([*runtime, "{model}", "{inputs}", "{outputs}"])
    target += f" --fault {shlex.quote(node)}=0.01"
    out = args.dir / "out"
    code = "import sys; from onnx_bisect.cli import bisect_entry; bisect_entry(sys.argv[1:])"
    argv = [sys.executable, "-c", code, str(path), "--target", target, "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with tempfile.TemporaryDirectory() as cwd, tempfile.TemporaryFile() as log:
        peak = measure(argv, interval=args.interval, env=env, cwd=Path(cwd), stdout=log)
        log.seek(0)
        text = log.read().decode(errors="replace")
    named = f"Root cause (culprit): {node}" in text
    stages = re.search(STAGES, text)
    print(
        f"exit {peak.returncode}; culprit named: {named}; wall {peak.wall_s:.1f} s; "
        f"float64; screen; scan; isolate s: {'; '.join(stages.groups()) if stages else '?'}; "
        f"peak tree {peak.peak_tree / GIB:.2f} GiB ({peak.peak_tree / weights:.2f}x the "
        f"{weights / GIB:.2f} GiB of weights); main {peak.peak_main / GIB:.2f} GiB; "
        f"load {os.getloadavg()[0]:.1f}"
    )
    return 0 if peak.returncode == 1 and named else 1


if __name__ == "__main__":
    sys.exit(main())
