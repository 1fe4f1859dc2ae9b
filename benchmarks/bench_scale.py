#!/usr/bin/env python3
"""Benchmark: does a diagnosis take time linear in the node count? A node-scaling table.

    python benchmarks/bench_scale.py [--nodes 1000,2000,5000,20000] [--targets exec,inproc]
                                     [--llm-layers 8,16]
                                     [--repeat 1] [--no-polygraphy] [--out bench-scale]

Models: ``benchmarks/models.mlp_blocks(N)``, chains of residual MLP blocks with a LayerNorm in
primitive ops (11 nodes a block, [64, 16] float32 activations, 4 kB a tensor), built into
``OUT/models/``. The fault is planted at the middle block's MatMul (``middle_matmul``), 5%.

With ``--llm-layers 8,16``, LLM rows too: ``benchmarks/llm.py``'s Llama (built with
transformers from a config, random weights, exported by torch.onnx; 24,576 values an
activation), a 1% fault in the middle layer's ``mlp/down_proj/MatMul`` through the simulated
runtime, at default settings (``--threshold auto``); the row's target is ``llm``.

Targets
    exec     the simulated faulty runtime ``examples/faulty_runtime.py --fault NODE=0.05``
             through ``exec:`` (a process per run)
    inproc   ``benchmarks/faulty_backend.py:FaultyOrt?node=NODE``: the same fault in ONNX
             Runtime in this process

Every command runs as a fresh subprocess under ``bench_yolo.measure`` (wall time of the
command itself; peak RSS of the largest single process of its tree). Columns:

    nodes        nodes in the model
    wall s       ``bisect MODEL --ref cpu --target T --out DIR --no-repro``: the command as a
                 user runs it (imports, float64 noise floors, screen, scan, isolation, every
                 report file) but the repro bundle, which bench_yolo times apart too (and
                 which repro.py cannot rebuild for a plugin target); median of --repeat
    x1k          wall s over the smallest model's
    runs         backend runs of the diagnosis (report.json ``runs``, summed)
    RSS MB       peak RSS, MiB (largest of --repeat)
    floor s      one fresh process running the model once, plainly, on ONNX Runtime and once
                 on the target (``bench_yolo``'s floor; ORT alone for ``inproc``)
    polygraphy s Polygraphy's mark-all workflow on ONNX Runtime (save, then compare), as in
                 bench_yolo; "-" without Polygraphy or with --no-polygraphy
    culprit      whether the root cause is exactly the planted node

Targets (per target kind): the largest model (20,000 nodes by default) within 12x the time
of the 2,000-node one, and within 40 s. Each is marked PASS or FAIL. The table and every
sample go to ``OUT/bench_scale.json``. Exit status 0 whether or not targets are met (a
measurement), 1 when a command failed unexpectedly.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import onnx  # noqa: E402

from benchmarks import bench_yolo as yolo  # noqa: E402
from benchmarks.models import middle_matmul, mlp_blocks  # noqa: E402

TARGET_RATIO = 12.0  # largest / 2k nodes
TARGET_WALL_S = 40.0
RATIO_BASE = 2000
SHAPES = {"x": (64, 16)}
TARGETS = ("exec", "inproc")


@dataclass
class Row:
    target: str
    nodes: int
    diagnosis: yolo.Series = field(default_factory=yolo.Series)
    floor: yolo.Series = field(default_factory=yolo.Series)
    polygraphy: yolo.Series = field(default_factory=yolo.Series)
    runs: int = 0
    culprit: bool | None = None
    timings: list[dict[str, float]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "nodes": self.nodes,
            "diagnosis": self.diagnosis.to_dict(),
            "floor": self.floor.to_dict(),
            "polygraphy": self.polygraphy.to_dict(),
            "runs": self.runs,
            "culprit": self.culprit,
            "timings_s_per_run": self.timings,
            "notes": self.notes,
        }


@dataclass(frozen=True)
class Case:
    """A model file (built once), the node its fault is planted at, and how large."""

    path: Path
    node: str
    nodes: int
    shapes: dict[str, tuple[int, ...]]
    fault: float = 0.05


def spec_for(kind: str, node: str, fault: float = 0.05) -> str:
    if kind in ("exec", "llm"):
        script = REPO / "examples" / "faulty_runtime.py"
        cmd = [sys.executable, str(script), "{model}", "{inputs}", "{outputs}"]
        return "exec:" + shlex.join([*cmd, "--fault", f"{node}={fault:g}"])
    return f"{REPO / 'benchmarks' / 'faulty_backend.py'}:FaultyOrt?node={node}"


def build(nodes: int, out: Path) -> Case:
    model = mlp_blocks(nodes)
    path = out / "models" / f"mlp{nodes}.onnx"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        onnx.save(model, str(path))
    return Case(path, middle_matmul(model), len(model.graph.node), SHAPES)


def build_llm(layers: int, out: Path) -> Case:
    """The Llama of ``layers`` layers (benchmarks/llm.py), a 1% fault in the middle layer's
    MLP down projection: issue 28's planted fault, found at default settings."""
    from benchmarks.llm import SEQ, down_proj, llama

    path = llama(layers, out / "models" / f"llama{layers}.onnx")
    model = onnx.load(str(path), load_external_data=False)
    node = down_proj(model, layers // 2)
    return Case(path, node, len(model.graph.node), {"input_ids": (1, SEQ)}, fault=0.01)


def bench_one(
    kind: str, case: Case, args: argparse.Namespace, bisect_argv: list[str], mark: list[str]
) -> Row:
    out: Path = args.out
    path, node = case.path, case.node
    row = Row(kind, case.nodes)
    work = out / kind / path.stem
    target = spec_for(kind, node, case.fault)
    for i in range(1, args.repeat + 1):
        tag = f"[{kind} {case.nodes} {i}/{args.repeat}]"
        ddir = work / "diagnosis"
        shutil.rmtree(ddir, ignore_errors=True)
        argv = [*bisect_argv, str(path), "--ref", "cpu", "--target", target, "--out", str(ddir)]
        argv.append("--no-repro")  # timed apart, as in bench_yolo (and a plugin has none)
        s = yolo.measure(argv, work / "logs" / f"diagnosis-{i}.log")
        if s.rc not in (0, 1):
            log = work / "logs" / f"diagnosis-{i}.log"
            raise yolo.BenchError(f"bisect exited {s.rc}:\n{yolo.log_tail(log)}")
        row.diagnosis.samples.append(s)
        report = json.loads((ddir / "report.json").read_text())
        row.runs = sum(int(v) for v in report.get("runs", {}).values())
        row.timings.append({k: float(v) for k, v in report.get("timings_s", {}).items()})
        named = (report.get("root_cause") or {}).get("nodes", [])
        row.culprit = named == [node]
        print(f"{tag} diagnosis {s.wall_s:7.2f} s {s.rss_mb:6.0f} MB runs {row.runs}", flush=True)

        floor_cfg = {
            "model": str(path),
            "inputs": str(ddir / "inputs.npz"),
            "shapes": {k: list(v) for k, v in case.shapes.items()},
            "target": yolo.floor_target(target),
        }
        if floor_cfg["target"]["kind"] == "none" and not row.notes:
            row.notes.append("floor: ORT alone (the in-process target is ORT plus one Mul)")
        floor_argv = [sys.executable, str(REPO / "benchmarks" / "bench_yolo.py")]
        floor_argv += [yolo.FLOOR_FLAG, json.dumps(floor_cfg)]
        s = yolo.measure(floor_argv, work / "logs" / f"floor-{i}.log")
        if s.rc != 0:
            raise yolo.BenchError(f"the floor process exited {s.rc}")
        row.floor.samples.append(s)
        print(f"{tag} floor     {s.wall_s:7.2f} s", flush=True)

        polygraphy = yolo.console_script("polygraphy")
        if mark and polygraphy is not None and kind == TARGETS[0]:  # the same for every target
            d = work / "polygraphy"
            s, _, note = yolo.polygraphy_once(polygraphy, mark, path, case.shapes, d)
            row.polygraphy.samples.append(s)
            print(f"{tag} polygraphy {s.wall_s:7.2f} s ({note})", flush=True)
    return row


def verdicts(rows: list[Row], kind: str) -> dict[str, tuple[float | None, bool | None]]:
    """(value, met) per target for one target kind; None where a size is missing."""
    mine = {r.nodes: r for r in rows if r.target == kind and r.diagnosis.samples}
    if not mine:
        return {}
    largest = mine[max(mine)]
    base = next((r for n, r in sorted(mine.items()) if n >= RATIO_BASE * 0.99), None)
    ratio = None
    if base is not None and base is not largest and base.diagnosis.wall_s:
        ratio = (largest.diagnosis.wall_s or 0.0) / base.diagnosis.wall_s
    wall = largest.diagnosis.wall_s
    return {
        "ratio": (ratio, None if ratio is None else ratio <= TARGET_RATIO),
        "wall": (wall, None if wall is None else wall <= TARGET_WALL_S),
    }


def render(rows: list[Row]) -> str:
    head = (
        f"{'target':<7} {'nodes':>6} {'wall s':>7} {'x1k':>6} {'runs':>5} {'RSS MB':>7} "
        f"{'floor s':>7} {'polygraphy s':>12} culprit"
    )
    lines = [head, "-" * len(head)]
    for kind in dict.fromkeys(r.target for r in rows):
        mine = [r for r in rows if r.target == kind]
        first = mine[0].diagnosis.wall_s if mine else None
        for r in mine:
            wall = r.diagnosis.wall_s
            x = wall / first if wall is not None and first else None
            culprit = "-" if r.culprit is None else "yes" if r.culprit else "NO"
            lines.append(
                f"{kind:<7} {r.nodes:>6} {yolo._fmt(wall, '7.2f')} {yolo._fmt(x, '6.2f')} "
                f"{r.runs:>5} {yolo._fmt(r.diagnosis.rss_mb, '7.0f')} "
                f"{yolo._fmt(r.floor.wall_s, '7.2f')} {yolo._fmt(r.polygraphy.wall_s, '12.2f')} "
                f"{culprit}"
            )
        found = verdicts(rows, kind)
        ratio, ok = found.get("ratio", (None, None))
        lines.append(
            f"  {kind}: largest / {RATIO_BASE} nodes = {yolo._fmt(ratio, '.2f')}x "
            f"(<= {TARGET_RATIO:g}x): {_pass(ok)}"
        )
        wall, ok = found.get("wall", (None, None))
        lines.append(
            f"  {kind}: largest model {yolo._fmt(wall, '.2f')} s (<= {TARGET_WALL_S:g} s): "
            f"{_pass(ok)}"
        )
        for r in mine:
            for note in r.notes:
                lines.append(f"  note ({r.nodes}): {note}")
    return "\n".join(lines)


def _pass(ok: bool | None) -> str:
    return "-" if ok is None else "PASS" if ok else "FAIL"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Time a diagnosis against the node count.")
    p.add_argument("--nodes", default="1000,2000,5000,20000", help="node counts, ascending")
    p.add_argument("--targets", default=",".join(TARGETS), help=f"any of {', '.join(TARGETS)}")
    p.add_argument(
        "--llm-layers",
        default="",
        help="LLM rows: decoder layers of benchmarks/llm.py's Llama, comma-separated "
        "(needs torch and transformers); a 1%% fault in the middle layer's down_proj",
    )
    p.add_argument("--repeat", type=int, default=1, help="repetitions per measurement")
    p.add_argument("--no-polygraphy", action="store_true", help="skip the mark-all workflow")
    p.add_argument("--out", type=Path, default=Path("bench-scale"), help="output directory")
    args = p.parse_args(argv)
    try:
        args.nodes = sorted(int(n) for n in args.nodes.split(",") if n.strip())
    except ValueError:
        p.error("--nodes: whole numbers, comma-separated")
    if not args.nodes or min(args.nodes) < 11:
        p.error("--nodes: at least one count, each at least 11 (one block)")
    try:
        args.llm_layers = [int(n) for n in args.llm_layers.split(",") if n.strip()]
    except ValueError:
        p.error("--llm-layers: whole numbers, comma-separated")
    args.targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    if set(args.targets) - set(TARGETS) or not (args.targets or args.llm_layers):
        p.error(f"--targets: choose from {', '.join(TARGETS)}")
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    args.out = args.out.resolve()
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    script = yolo.console_script("bisect")
    bisect_argv = (
        [str(script)]
        if script
        else [sys.executable, "-c", "from onnx_bisect.entry import bisect_entry; bisect_entry()"]
    )
    polygraphy = None if args.no_polygraphy else yolo.console_script("polygraphy")
    mark = yolo.mark_all_spelling(polygraphy) if polygraphy is not None else []
    load_start = yolo.load_average()
    rows: list[Row] = []
    failed = False
    cases = [(kind, nodes) for kind in args.targets for nodes in args.nodes]
    cases += [("llm", layers) for layers in args.llm_layers]
    for kind, size in cases:
        try:
            made = build_llm(size, args.out) if kind == "llm" else build(size, args.out)
            rows.append(bench_one(kind, made, args, bisect_argv, mark))
        except yolo.BenchError as exc:
            failed = True
            print(f"[{kind} {size}] error: {exc}", file=sys.stderr)
    load_end = yolo.load_average()
    print()
    print(render(rows))
    print(f"\n1-min load average: {load_start} at start, {load_end} at end ({os.cpu_count()} CPUs)")
    doc = {
        "schema": "onnx-bisect-bench-scale/1",
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *sys.argv]),
        "targets": {
            "ratio_max": TARGET_RATIO,
            "ratio_base_nodes": RATIO_BASE,
            "wall_s_max": TARGET_WALL_S,
        },  # fmt: skip
        "environment": yolo.environment(),
        "load_average_1min": {"start": load_start, "end": load_end},
        "rows": [r.to_dict() for r in rows],
        "verdicts": {k: verdicts(rows, k) for k in dict.fromkeys(r.target for r in rows)},
    }
    (args.out / "bench_scale.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(f"written {args.out / 'bench_scale.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
