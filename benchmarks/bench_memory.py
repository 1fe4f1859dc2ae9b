#!/usr/bin/env python3
"""Benchmark: does ``--max-memory`` bound the whole process tree? A memory-budget table.

    python benchmarks/bench_memory.py [--nets small,big] [--budgets 256MB,1GB,4GB,64GB]
                                      [--threshold auto|1e-3] [--target exec|cpu]
                                      [--out bench-memory]

Nets (``benchmarks/memtree.conv_net``: residual blocks of a 3x3 depthwise Conv, Relu, 1x1 Conv
and Add on 1x64xHxW float32; weights of a few kilobytes, so the budget is all that counts):

    small   28 blocks (112 nodes) at 128x128:   4 MiB a tensor, 448 MiB of intermediates
    big     28 blocks (112 nodes) at 512x512:  64 MiB a tensor, 7 GiB of intermediates
            (the model of issue 14's table)

Each row is one ``bisect NET --ref cpu --target T --max-memory B --out DIR`` run through the
real CLI in a fresh process, with the planted fault at ``block10/pw`` (T = ``exec:`` the
simulated faulty runtime ``examples/faulty_runtime.py --fault block10/pw=0.05``; with
``--target cpu``, ``cpu?opt=disable --always-scan``, an in-process target that scans and
isolates without a fault). The process tree's resident memory is sampled every 20 ms
(``benchmarks/memtree.py``: the SUM over onnx-bisect and every process below it).

Columns
    net, budget     the model and ``--max-memory`` (binary units, as the CLI reads them)
    thresh.         ``--threshold`` (auto: the float64 oracle runs, and needs twice the room)
    interm.         bytes of every tensor the net computes
    peak tree       peak of the summed resident memory of the tree, MiB
    overhead        peak tree - budget - weights, MiB: what the budget does not cover
    wall s          the command's wall time
    runs            backend runs (report.json ``runs``)
    culprit         whether the planted node was named exactly (exec target only)
    result          PASS when overhead <= 600 MiB and the culprit was found; ERROR (exit 2)
                    when the budget is below what one run needs, with the tool's message

The table is printed and written with every figure to ``OUT/bench_memory.json``. Exit status
0 unless a run failed unexpectedly (an exit other than 0, 1 and 2).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.memtree import conv_net, intermediate_bytes, measure  # noqa: E402
from onnx_bisect.cli.params import parse_bytes  # noqa: E402
from onnx_bisect.engine.measure.memory import FIXED_OVERHEAD  # noqa: E402

FAULT = "block10/pw"
NETS = {"test": (64, 64), "small": (28, 128), "big": (28, 512)}
MIB = 1 << 20


@dataclass(frozen=True)
class Row:
    net: str
    budget: str
    threshold: str
    budget_bytes: int
    intermediates: int
    weights: int
    peak_tree: int
    peak_main: int
    peak_children: int
    wall_s: float
    exit_code: int
    runs: dict[str, int]
    culprit: bool | None
    message: str

    @property
    def overhead(self) -> int:
        return self.peak_tree - self.budget_bytes - self.weights

    @property
    def result(self) -> str:
        if self.exit_code == 2:
            return "ERROR"
        ok = self.overhead <= FIXED_OVERHEAD and self.culprit is not False
        return "PASS" if ok else "FAIL"


def _command(
    model: Path, budget: str, threshold: str, target: str, out: Path, code: Path
) -> list[str]:
    py = sys.executable
    if target == "exec":
        runtime = [py, str(code / "examples" / "faulty_runtime.py"), "{model}", "{inputs}"]
        spec = "exec:" + shlex.join([*runtime, "{outputs}", "--fault", f"{FAULT}=0.05"])
        extra: list[str] = []
    else:
        spec, extra = "cpu?opt=disable", ["--always-scan"]
    entry = "from onnx_bisect.entry import bisect_entry; bisect_entry()"
    return [py, "-c", entry, str(model), "--ref", "cpu", "--target", spec,
            "--max-memory", budget, "--threshold", threshold, "--out", str(out), "--quiet",
            *extra]  # fmt: skip


def run_row(
    net: str, budget: str, target: str, out: Path, code: Path = REPO, threshold: str = "auto"
) -> Row:
    blocks, size = NETS[net]
    model_path = out / f"{net}.onnx"
    if not model_path.exists():
        import onnx

        onnx.save(conv_net(blocks, size), model_path)
    import onnx

    weights = sum(t.ByteSize() for t in onnx.load(model_path).graph.initializer)
    report_dir = out / f"{net}-{budget}-{threshold}-{target}"
    log = out / f"{net}-{budget}-{threshold}-{target}.log"
    env = dict(os.environ, PYTHONPATH=str(code))
    argv = _command(model_path, budget, threshold, target, report_dir, code)
    with open(log, "wb") as f:
        # From the checkout's own directory: ``python -c`` puts the cwd first on sys.path.
        peak = measure(argv, env=env, cwd=code, stdout=f, stderr=subprocess.STDOUT)
    message = log.read_text(errors="replace").strip().splitlines()[-1:] if peak.returncode else []
    runs: dict[str, int] = {}
    culprit: bool | None = None
    report = report_dir / "report.json"
    if peak.returncode in (0, 1) and report.exists():
        data = json.loads(report.read_text())
        runs = data.get("runs", {})
        if target == "exec":
            cause = data.get("root_cause") or {}
            culprit = tuple(cause.get("nodes", ())) == (FAULT,)
    return Row(
        net, budget, threshold, parse_bytes(budget), intermediate_bytes(blocks, size), weights,
        peak.peak_tree, peak.peak_main, peak.peak_children, peak.wall_s, peak.returncode,
        runs, culprit, message[0] if message and peak.returncode == 2 else "",
    )  # fmt: skip


def _table(rows: list[Row]) -> str:
    head = (f"{'net':6} {'budget':>7} {'thresh.':>7} {'interm.':>9} {'peak tree':>10} "
            f"{'overhead':>9} {'wall s':>7} {'runs':>22} {'culprit':>8} result")  # fmt: skip
    lines = [head, "-" * len(head)]
    for r in rows:
        runs = ", ".join(f"{k} {v}" for k, v in r.runs.items())
        found = "-" if r.culprit is None else ("yes" if r.culprit else "NO")
        lines.append(
            f"{r.net:6} {r.budget:>7} {r.threshold:>7} {r.intermediates / MIB:>6.0f}MiB"
            f" {r.peak_tree / MIB:>7.0f}MiB"
            f" {r.overhead / MIB:>6.0f}MiB {r.wall_s:>7.1f} {runs:>22} {found:>8} {r.result}"
        )
        if r.message:
            lines.append(f"       {r.message}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nets", default="small,big")
    p.add_argument("--budgets", default="256MB,1GB,4GB,64GB")
    p.add_argument("--target", choices=("exec", "cpu"), default="exec")
    p.add_argument("--threshold", default="auto", help="passed on (auto runs the float64 oracle)")
    p.add_argument("--out", type=Path, default=Path("bench-memory"))
    p.add_argument(
        "--code", type=Path, default=REPO, help="the onnx-bisect checkout to run (before/after)"
    )
    args = p.parse_args(argv)
    args.out = args.out.resolve()  # the commands run from the checkout's directory
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    load = os.getloadavg()[0]
    for net in args.nets.split(","):
        for budget in args.budgets.split(","):
            row = run_row(net, budget, args.target, args.out, args.code.resolve(), args.threshold)
            rows.append(row)
            print(_table([row]).splitlines()[-1 if not row.message else -2], flush=True)
    print()
    end = os.getloadavg()[0]
    print(
        f"target: overhead <= {FIXED_OVERHEAD / MIB:.0f} MiB over budget + weights; load "
        f"average {load:.1f} at start, {end:.1f} at end ({started}; code {args.code})"
    )
    print(_table(rows))
    data = [{**asdict(r), "overhead": r.overhead, "result": r.result} for r in rows]
    (args.out / "bench_memory.json").write_text(json.dumps(data, indent=2) + "\n")
    return 1 if any(r.exit_code not in (0, 1, 2) for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
