#!/usr/bin/env python3
"""Benchmark: what a full ``bisect`` diagnosis costs on YOLO-style detectors, against yardsticks.

    python benchmarks/bench_yolo.py [--models yolo_like,yolov8n-320] [--repeat 3]
                                    [--target SPEC] [--nudenet PATH] [--out bench-out]

Models
    ``yolo_like``    the shipped example detector ``examples/models/yolo_like.onnx``, input
                     ``images`` at 1x3x160x160 (its batch dim is dynamic).
    ``yolov8n-320``  YOLOv8n at 320x320, ``320n.onnx`` from the ``nudenet`` wheel, input
                     ``images`` at 1x3x320x320. Looked for at ``--nudenet PATH``, else at
                     ``OUT/320n.onnx``, else fetched with ``pip download --no-deps nudenet -d OUT``
                     and extracted from the wheel; when none of that works it is skipped with the
                     reason printed.

Every measured command runs as a fresh subprocess under a tiny Python wrapper that times it and
reads ``getrusage(RUSAGE_CHILDREN).ru_maxrss`` afterwards, so wall time excludes the wrapper's
own start-up and peak RSS is the largest resident set of any one process in the command's tree
(the maximum, not the sum, of concurrent processes). Each measurement is repeated ``--repeat``
times (interleaved: diagnosis, floor, polygraphy, diagnosis, ...); the table shows the median
wall time and the largest peak RSS.

Columns
    diag s        wall time of ``bisect MODEL --ref cpu --target T --shape ... --out DIR`` (console
                  script next to ``sys.executable``): imports, screen, scan, isolation and the
                  report files. T is ``openvino`` (its default precision, bf16 on CPUs with
                  AVX512-BF16/AMX, which diverges from the fp32 reference so the whole pipeline
                  runs); without OpenVINO it is the simulated faulty runtime
                  ``examples/faulty_runtime.py`` through ``exec:`` with a 5% fault at the model's
                  first Conv. ``--target`` overrides it.
    floor s       wall time of one fresh process that imports onnxruntime and the target's library
                  and runs the model once, plainly, on each (ORT CPU session; OpenVINO
                  read/reshape/compile/infer, or one run of the exec command) on the diagnosis's
                  own ``inputs.npz``: the least any diagnosis must pay.
    ratio         diag s / floor s. Target: <= 2.0.
    polygraphy s  the Polygraphy "mark all" workflow: ``polygraphy run MODEL --onnxrt
                  --onnx-outputs '*' --save-outputs golden.json --input-shapes images:[...]`` then
                  the same with ``--load-outputs golden.json`` to compare; the two wall times
                  summed. (Polygraphy 0.53 spells "mark all" as ``'*'``; older releases as
                  ``mark all``, which the script falls back to.)
    ort pair s    the same diagnosis on the work Polygraphy's workflow does: ``--ref cpu --target
                  'cpu?opt=disable' --always-scan`` (ONNX Runtime on both sides, every tensor
                  marked and compared, plus isolation), so the comparison is like for like.
    speedup       polygraphy s / ort pair s. Target: >= 5.0.
    diag RSS MB   peak resident set of the diagnosis process, MiB. Target: <= 400.
    runs          backend runs the diagnosis made, from report.json ``runs``.

Each target gets PASS or MISS. The table is also written to ``OUT/bench.json`` together with
every sample, the diagnosis's own phase timings (report.json ``timings_s``) and the floor's
phase timings. The exit status is 0 whether or not targets are met (this is a measurement, not
a test); it is 1 when a measured command failed unexpectedly, and a model that cannot be had is
skipped, not failed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as dist_version
from importlib.util import find_spec
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # not resolved: a venv's bin/ holds its console scripts

TARGET_RATIO = 2.0
TARGET_SPEEDUP = 5.0
TARGET_RSS_MB = 400.0
COMMAND_TIMEOUT_S = 1800.0
FLOOR_FLAG = "--floor-child"

# Runs argv[2:], then writes {"rc", "wall_s", "maxrss"} as JSON to argv[1].
_WRAPPER = (
    "import json,resource,subprocess,sys,time\n"
    "t=time.perf_counter()\n"
    "rc=subprocess.run(sys.argv[2:]).returncode\n"
    "wall=time.perf_counter()-t\n"
    "rss=resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss\n"
    "open(sys.argv[1],'w').write(json.dumps({'rc':rc,'wall_s':wall,'maxrss':rss}))\n"
)


class BenchError(Exception):
    """A measured command failed in a way that makes its numbers meaningless."""


@dataclass(frozen=True)
class ModelSpec:
    name: str
    description: str
    shapes: Mapping[str, tuple[int, ...]]


MODELS: dict[str, ModelSpec] = {
    "yolo_like": ModelSpec(
        "yolo_like",
        "examples/models/yolo_like.onnx (shipped example)",
        {"images": (1, 3, 160, 160)},
    ),
    "yolov8n-320": ModelSpec(
        "yolov8n-320", "YOLOv8n-320, 320n.onnx from the nudenet wheel", {"images": (1, 3, 320, 320)}
    ),
}


@dataclass(frozen=True)
class Sample:
    wall_s: float
    rss_mb: float
    rc: int


@dataclass
class Series:
    """Repeated samples of one measurement."""

    samples: list[Sample] = field(default_factory=list)

    @property
    def wall_s(self) -> float | None:
        return statistics.median(s.wall_s for s in self.samples) if self.samples else None

    @property
    def rss_mb(self) -> float | None:
        return max(s.rss_mb for s in self.samples) if self.samples else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "wall_s_median": _round(self.wall_s),
            "rss_mb_max": _round(self.rss_mb, 1),
            "wall_s_samples": [round(s.wall_s, 4) for s in self.samples],
            "rss_mb_samples": [round(s.rss_mb, 1) for s in self.samples],
            "exit_codes": [s.rc for s in self.samples],
        }


@dataclass
class Row:
    model: str
    description: str
    path: str = ""
    shapes: dict[str, list[int]] = field(default_factory=dict)
    status: str = "ok"  # ok | skipped | error
    reason: str = ""
    target: str = ""
    target_description: str = ""
    diagnosis: Series = field(default_factory=Series)
    # The same work as Polygraphy's workflow (ORT on both sides, every tensor marked), done by
    # onnx-bisect with --always-scan: the fair baseline for the speedup column.
    ort_pair: Series = field(default_factory=Series)
    floor: Series = field(default_factory=Series)
    polygraphy: Series = field(default_factory=Series)
    polygraphy_note: str = ""
    polygraphy_parts_s: list[dict[str, float]] = field(default_factory=list)
    runs: dict[str, int] = field(default_factory=dict)
    timings_runs: list[dict[str, float]] = field(default_factory=list)
    floor_phase_runs: list[dict[str, float]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def timings_s(self) -> dict[str, float]:
        """report.json ``timings_s`` of the diagnosis run with the median wall time."""
        return _at_median(self.diagnosis, self.timings_runs)

    @property
    def floor_phases_s(self) -> dict[str, float]:
        return _at_median(self.floor, self.floor_phase_runs)

    @property
    def ratio(self) -> float | None:
        d, f = self.diagnosis.wall_s, self.floor.wall_s
        return d / f if d is not None and f else None

    @property
    def speedup(self) -> float | None:
        d, p = self.ort_pair.wall_s, self.polygraphy.wall_s
        return p / d if d and p is not None else None

    def verdicts(self) -> dict[str, bool | None]:
        rss = self.diagnosis.rss_mb
        return {
            "ratio": None if self.ratio is None else self.ratio <= TARGET_RATIO,
            "speedup": None if self.speedup is None else self.speedup >= TARGET_SPEEDUP,
            "rss": None if rss is None else rss <= TARGET_RSS_MB,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "description": self.description,
            "path": self.path,
            "shapes": self.shapes,
            "status": self.status,
            "reason": self.reason,
            "target": self.target,
            "target_description": self.target_description,
            "diagnosis": {
                **self.diagnosis.to_dict(),
                "runs": self.runs,
                "timings_s": self.timings_s,
                "timings_s_per_run": self.timings_runs,
            },
            "ort_pair": self.ort_pair.to_dict(),
            "floor": {
                **self.floor.to_dict(),
                "phases_s": self.floor_phases_s,
                "phases_s_per_run": self.floor_phase_runs,
            },
            "polygraphy": {
                **self.polygraphy.to_dict(),
                "parts_s": self.polygraphy_parts_s,
                "note": self.polygraphy_note,
            },
            "ratio": _round(self.ratio),
            "speedup": _round(self.speedup),
            "pass": self.verdicts(),
            "notes": self.notes,
        }


def _at_median(series: Series, per_run: Sequence[dict[str, float]]) -> dict[str, float]:
    """The entry of ``per_run`` that belongs to the sample with the (lower) median wall time."""
    if not per_run or len(per_run) != len(series.samples):
        return dict(per_run[-1]) if per_run else {}
    order = sorted(range(len(per_run)), key=lambda i: series.samples[i].wall_s)
    return dict(per_run[order[(len(order) - 1) // 2]])


def _round(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(x, digits)


# --- running and measuring ---------------------------------------------------------------------


def measure(argv: Sequence[str], log: Path, timeout: float = COMMAND_TIMEOUT_S) -> Sample:
    """Run ``argv`` under the wrapper; stdout and stderr go to ``log``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    fd, result_name = tempfile.mkstemp(prefix="bench-", suffix=".json")
    os.close(fd)
    result = Path(result_name)
    cmd = [sys.executable, "-c", _WRAPPER, str(result), *argv]
    try:
        with log.open("w") as fh:
            fh.write(f"$ {shlex.join(argv)}\n")
            fh.flush()
            proc = subprocess.Popen(
                cmd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise BenchError(f"timed out after {timeout:.0f}s: {shlex.join(argv)}") from None
        text = result.read_text()
        if not text:
            raise BenchError(f"the measuring wrapper wrote nothing (exit {proc.returncode})")
        data = json.loads(text)
    finally:
        result.unlink(missing_ok=True)
    # ru_maxrss is KiB on Linux, bytes on macOS.
    rss_bytes = data["maxrss"] * (1 if sys.platform == "darwin" else 1024)
    return Sample(float(data["wall_s"]), rss_bytes / 2**20, int(data["rc"]))


def log_tail(log: Path, lines: int = 8) -> str:
    try:
        text = log.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return "\n".join("    " + line for line in text[-lines:])


def console_script(name: str) -> Path | None:
    for candidate in (BIN / name, BIN / f"{name}.exe"):
        if candidate.is_file():
            return candidate
    found = shutil.which(name)
    return Path(found) if found else None


def shape_text(shape: Sequence[int], sep: str = "x") -> str:
    return sep.join(str(d) for d in shape)


# --- the models --------------------------------------------------------------------------------


def find_nudenet(explicit: Path | None, out: Path) -> tuple[Path | None, str]:
    """``(path, "")`` for 320n.onnx, or ``(None, reason)``. Never raises."""
    if explicit is not None:
        if explicit.is_file():
            return explicit, ""
        return None, f"--nudenet {explicit}: no such file"
    cached = out / "320n.onnx"
    if cached.is_file():
        return cached, ""
    wheels = sorted(out.glob("nudenet-*.whl"))
    if not wheels:
        argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
        argv += ["nudenet", "-d", str(out)]
        print(f"fetching the nudenet wheel: {shlex.join(argv)}", file=sys.stderr)
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=900)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return None, f"pip download nudenet failed: {exc}"
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            return None, f"pip download nudenet failed (exit {proc.returncode}): {last}"
        wheels = sorted(out.glob("nudenet-*.whl"))
        if not wheels:
            return None, "pip download nudenet produced no wheel"
    wheel = wheels[-1]
    try:
        with zipfile.ZipFile(wheel) as z:
            data = z.read("nudenet/320n.onnx")
        part = cached.with_name(cached.name + ".part")
        part.write_bytes(data)
        part.replace(cached)
    except (KeyError, zipfile.BadZipFile, OSError) as exc:
        return None, f"cannot extract nudenet/320n.onnx from {wheel.name}: {exc}"
    return cached, ""


def model_path(spec: ModelSpec, nudenet: Path | None, out: Path) -> tuple[Path | None, str]:
    if spec.name == "yolo_like":
        path = REPO / "examples" / "models" / "yolo_like.onnx"
        return (path, "") if path.is_file() else (None, f"{path} is missing")
    return find_nudenet(nudenet, out)


def first_conv(path: Path) -> str:
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    for node in model.graph.node:
        if node.op_type == "Conv":
            return str(node.name)
    raise BenchError(f"{path.name} has no Conv node for the simulated fault")


def default_target(path: Path) -> str:
    """``openvino`` when installed (bf16 by default diverges); else the simulated faulty runtime."""
    if find_spec("openvino") is not None:
        return "openvino"
    script = REPO / "examples" / "faulty_runtime.py"
    cmd = [sys.executable, str(script), "{model}", "{inputs}", "{outputs}"]
    cmd += ["--fault", f"{first_conv(path)}=0.05"]
    return "exec:" + shlex.join(cmd)


def floor_target(target: str) -> dict[str, Any]:
    """How the floor process runs ``target`` plainly (parsed with the tool's own spec grammar)."""
    from onnx_bisect.backends.spec import parse_spec

    spec = parse_spec(target)
    if spec.name == "openvino":
        precision = spec.options.get("precision")
        hint = (
            {"fp32": "f32", "fp16": "f16"}.get(precision.lower(), precision.lower())
            if precision
            else None
        )
        return {"kind": "openvino", "device": (spec.device or "CPU").upper(), "precision": hint}
    if spec.name == "exec":
        return {"kind": "exec", "argv": shlex.split(spec.device or "")}
    if spec.name == "ort":
        return {"kind": "ort", "device": spec.device or "cpu"}
    if spec.name == "ref":
        return {"kind": "ref"}
    return {"kind": "none", "name": spec.name}


# --- the floor process ---------------------------------------------------------------------------


def floor_child(config_text: str) -> int:
    """Run in a fresh process: import ORT and the target library, run the model once on each."""
    t0 = time.perf_counter()
    phases: dict[str, float] = {}

    def lap(name: str, start: float) -> float:
        now = time.perf_counter()
        phases[name] = round(now - start, 4)
        return now

    cfg = json.loads(config_text)
    model: str = cfg["model"]
    target: dict[str, Any] = cfg["target"]
    import numpy as np
    import onnxruntime as ort

    t = lap("import_ort", t0)
    feeds: dict[str, Any]
    if cfg.get("inputs") and Path(cfg["inputs"]).is_file():
        with np.load(cfg["inputs"], allow_pickle=False) as z:
            feeds = {k: z[k] for k in z.files}
    else:
        rng = np.random.default_rng(0)
        feeds = {k: rng.random(v, dtype=np.float32) for k, v in cfg["shapes"].items()}
    sess = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    t = lap("ort_session", t)
    sess.run(None, feeds)
    t = lap("ort_run", t)
    kind = target["kind"]
    if kind == "openvino":
        import openvino as ov

        t = lap("import_openvino", t)
        core = ov.Core()
        ov_model = core.read_model(model)
        ov_model.reshape({k: list(v.shape) for k, v in feeds.items()})
        config = {"INFERENCE_PRECISION_HINT": target["precision"]} if target["precision"] else {}
        compiled = core.compile_model(ov_model, target["device"], config)
        t = lap("openvino_compile", t)
        compiled.create_infer_request().infer(feeds)
        t = lap("openvino_infer", t)
    elif kind == "exec":
        with tempfile.TemporaryDirectory(prefix="bench-floor-") as tmp:
            inputs, outputs = Path(tmp) / "inputs.npz", Path(tmp) / "outputs.npz"
            np.savez(inputs, **feeds)
            paths = {"{model}": model, "{inputs}": str(inputs), "{outputs}": str(outputs)}
            argv = list(target["argv"])
            for key, value in paths.items():
                argv = [a.replace(key, value) for a in argv]
            subprocess.run(argv, check=True)
        t = lap("exec_run", t)
    elif kind == "ort":
        providers = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}
        provider = providers.get(target["device"], target["device"])
        ort.InferenceSession(model, providers=[provider, "CPUExecutionProvider"]).run(None, feeds)
        t = lap("target_ort_run", t)
    elif kind == "ref":
        import onnx.reference

        onnx.reference.ReferenceEvaluator(model).run(None, feeds)
        t = lap("reference_run", t)
    phases["total"] = round(time.perf_counter() - t0, 4)
    print("FLOOR " + json.dumps(phases))
    return 0


def floor_phases(log: Path) -> dict[str, float]:
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return {}
    for line in reversed(lines):
        if line.startswith("FLOOR "):
            return {k: float(v) for k, v in json.loads(line[len("FLOOR ") :]).items()}
    return {}


# --- Polygraphy --------------------------------------------------------------------------------


def mark_all_spelling(polygraphy: Path) -> list[str]:
    """``['*']`` where ``polygraphy run --help`` documents it (0.53+), else ``['mark', 'all']``."""
    try:
        proc = subprocess.run(
            [str(polygraphy), "run", "--help"], capture_output=True, text=True, timeout=120
        )
    except (OSError, subprocess.TimeoutExpired):
        return ["mark", "all"]
    help_text = " ".join((proc.stdout + proc.stderr).split())
    return ["*"] if "'*' alone marks all" in help_text else ["mark", "all"]


def polygraphy_once(
    polygraphy: Path, mark: Sequence[str], model: Path, shapes: Mapping[str, Sequence[int]], d: Path
) -> tuple[Sample, dict[str, float], str]:
    """The two-command mark-all workflow; (summed sample, parts, note)."""
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    golden = d / "golden.json"
    shape_args = ["--input-shapes", *(f"{k}:[{shape_text(v, ',')}]" for k, v in shapes.items())]
    base = [str(polygraphy), "run", str(model), "--onnxrt", "--onnx-outputs", *mark]
    save = measure([*base, "--save-outputs", str(golden), *shape_args], d / "save.log")
    if save.rc != 0 or not golden.is_file():
        raise BenchError(
            f"polygraphy --save-outputs failed (exit {save.rc}):\n{log_tail(d / 'save.log')}"
        )
    size_mb = golden.stat().st_size / 2**20
    load = measure([*base, "--load-outputs", str(golden), *shape_args], d / "compare.log")
    note = f"golden.json {size_mb:.0f} MB"
    if load.rc != 0:
        note += f"; the comparing run exited {load.rc} (timing kept)"
    total = Sample(save.wall_s + load.wall_s, max(save.rss_mb, load.rss_mb), load.rc)
    parts = {"save_s": round(save.wall_s, 4), "compare_s": round(load.wall_s, 4)}
    golden.unlink(missing_ok=True)  # large; the logs stay
    return total, parts, note


# --- one model ---------------------------------------------------------------------------------


def bench_model(
    spec: ModelSpec, path: Path, target: str, repeat: int, out: Path, bisect_argv: list[str]
) -> Row:
    row = Row(spec.name, spec.description, path=str(path), target=target)
    row.shapes = {k: list(v) for k, v in spec.shapes.items()}
    work = out / spec.name
    shape_args = [a for k, v in spec.shapes.items() for a in ("--shape", f"{k}={shape_text(v)}")]
    plain = floor_target(target)
    floor_cfg: dict[str, Any] = {
        "model": str(path),
        "inputs": str(work / "diagnosis" / "inputs.npz"),
        "shapes": row.shapes,
        "target": plain,
    }
    if plain["kind"] == "none":
        row.notes.append(f"floor: no plain runner for {target!r}; the floor is ORT alone")
    polygraphy = console_script("polygraphy")
    mark: list[str] = []
    if polygraphy is None:
        row.polygraphy_note = "skipped: polygraphy is not installed (pip install polygraphy)"
    else:
        mark = mark_all_spelling(polygraphy)

    for i in range(1, repeat + 1):
        tag = f"[{spec.name} {i}/{repeat}]"
        # 1. full diagnosis
        ddir = work / "diagnosis"
        shutil.rmtree(ddir, ignore_errors=True)
        argv = [*bisect_argv, str(path), "--ref", "cpu", "--target", target, *shape_args]
        argv += ["--out", str(ddir), "--no-repro"]  # the repro bundle is timed apart
        log = work / "logs" / f"diagnosis-{i}.log"
        s = measure(argv, log)
        if s.rc not in (0, 1):
            raise BenchError(f"bisect exited {s.rc}:\n{log_tail(log)}")
        row.diagnosis.samples.append(s)
        report = json.loads((ddir / "report.json").read_text())
        row.runs = {k: int(v) for k, v in report.get("runs", {}).items()}
        row.timings_runs.append({k: float(v) for k, v in report.get("timings_s", {}).items()})
        row.target_description = str(report.get("target", {}).get("description", ""))
        if s.rc == 0 and "no divergence" not in " ".join(row.notes):
            row.notes.append("no divergence: the diagnosis stopped after the screen")
        print(f"{tag} diagnosis {s.wall_s:7.2f} s {s.rss_mb:7.0f} MB  runs {row.runs}", flush=True)

        # 1b. the same diagnosis with ORT on both sides, forced through scan and isolation
        ddir = work / "ort-pair"
        shutil.rmtree(ddir, ignore_errors=True)
        argv = [*bisect_argv, str(path), "--ref", "cpu", "--target", "cpu?opt=disable"]
        argv += [*shape_args, "--always-scan", "--no-repro", "--out", str(ddir)]
        s = measure(argv, work / "logs" / f"ort-pair-{i}.log")
        if s.rc not in (0, 1):
            raise BenchError(f"bisect (ORT pair) exited {s.rc}")
        row.ort_pair.samples.append(s)
        print(f"{tag} ort pair  {s.wall_s:7.2f} s {s.rss_mb:7.0f} MB", flush=True)

        # 2. floor
        log = work / "logs" / f"floor-{i}.log"
        s = measure(
            [sys.executable, str(Path(__file__).resolve()), FLOOR_FLAG, json.dumps(floor_cfg)], log
        )
        if s.rc != 0:
            raise BenchError(f"the floor process exited {s.rc}:\n{log_tail(log)}")
        row.floor.samples.append(s)
        row.floor_phase_runs.append(floor_phases(log))
        print(f"{tag} floor     {s.wall_s:7.2f} s {s.rss_mb:7.0f} MB", flush=True)

        # 3. Polygraphy mark-all workflow
        if polygraphy is not None:
            s, parts, note = polygraphy_once(
                polygraphy, mark, path, spec.shapes, work / "polygraphy"
            )
            row.polygraphy.samples.append(s)
            row.polygraphy_parts_s.append(parts)
            row.polygraphy_note = f"--onnx-outputs {' '.join(mark)}; {note}"
            print(f"{tag} polygraphy{s.wall_s:7.2f} s {s.rss_mb:7.0f} MB  ({note})", flush=True)
    return row


# --- output ------------------------------------------------------------------------------------


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _mark(ok: bool | None) -> str:
    return "" if ok is None else "PASS" if ok else "MISS"


def render_table(rows: Sequence[Row]) -> str:
    head = (
        f"{'model':<12} {'input':<12} {'diag s':>7} {'floor s':>7} {'ratio':>6} {'<=2x':<4} "
        f"{'ort pair s':>10} {'polygraphy s':>12} {'speedup':>7} {'>=5x':<4} {'diag RSS MB':>11} "
        f"{'<=400':<5}  runs"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        shape = ",".join(shape_text(v) for v in r.shapes.values()) or "-"
        if r.status != "ok":
            lines.append(f"{r.model:<12} {shape:<12} {r.status}: {r.reason.splitlines()[0]}")
            continue
        v = r.verdicts()
        runs = ", ".join(f"{k} {n}" for k, n in r.runs.items())
        lines.append(
            f"{r.model:<12} {shape:<12} {_fmt(r.diagnosis.wall_s, '7.2f')} "
            f"{_fmt(r.floor.wall_s, '7.2f')} {_fmt(r.ratio, '6.2f')} {_mark(v['ratio']):<4} "
            f"{_fmt(r.ort_pair.wall_s, '10.2f')} "
            f"{_fmt(r.polygraphy.wall_s, '12.2f')} {_fmt(r.speedup, '7.2f')} "
            f"{_mark(v['speedup']):<4} {_fmt(r.diagnosis.rss_mb, '11.0f')} "
            f"{_mark(v['rss']):<5}  {runs}"
        )
    lines.append("")
    for r in rows:
        if r.status != "ok":
            continue
        lines.append(f"{r.model}: target {r.target_description or r.target}")
        phases = ", ".join(f"{k} {v:.2f}" for k, v in r.timings_s.items())
        lines.append(f"  diagnosis timings_s (median run): {phases}")
        lines.append(
            f"  diagnosis peak RSS per run MB: {[round(s.rss_mb) for s in r.diagnosis.samples]}"
        )
        fl = ", ".join(f"{k} {v:.2f}" for k, v in r.floor_phases_s.items())
        lines.append(
            f"  floor phases s (median run): {fl}; peak RSS {_fmt(r.floor.rss_mb, '.0f')} MB"
        )
        poly_rss = _fmt(r.polygraphy.rss_mb, ".0f")
        lines.append(f"  polygraphy: {r.polygraphy_note}; peak RSS {poly_rss} MB")
        for note in r.notes:
            lines.append(f"  note: {note}")
    return "\n".join(lines)


def load_average() -> float | None:
    """1-minute load average: other work on the machine inflates every wall time here."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def environment() -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
    }
    for dist in ("onnx-bisect", "onnx", "onnxruntime", "openvino", "polygraphy", "numpy"):
        try:
            env[dist] = dist_version(dist)
        except PackageNotFoundError:
            env[dist] = None
    return env


# --- main --------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Time a full onnx-bisect diagnosis against the plain-run floor and the "
        "Polygraphy mark-all workflow.",
    )
    p.add_argument(
        "--models",
        default=",".join(MODELS),
        help=f"comma-separated subset of: {', '.join(MODELS)} (default: all)",
    )
    p.add_argument("--repeat", type=int, default=3, help="repetitions per measurement (default 3)")
    p.add_argument(
        "--target",
        default=None,
        help="backend spec under test (default: openvino, else the simulated exec: runtime)",
    )
    p.add_argument("--nudenet", type=Path, default=None, help="path to nudenet's 320n.onnx")
    p.add_argument("--out", type=Path, default=Path("bench-out"), help="output directory")
    args = p.parse_args(argv)
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in names if m not in MODELS]
    if unknown or not names:
        p.error(
            f"--models: unknown {', '.join(unknown) or '(none given)'}; know {', '.join(MODELS)}"
        )
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    args.models = names
    return args


def main(argv: Sequence[str]) -> int:
    if len(argv) == 2 and argv[0] == FLOOR_FLAG:
        return floor_child(argv[1])
    args = parse_args(argv)
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    bisect_script = console_script("bisect")
    bisect_argv = (
        [str(bisect_script)]
        if bisect_script
        else [sys.executable, "-c", "from onnx_bisect.cli import bisect_entry; bisect_entry()"]
    )
    rows: list[Row] = []
    failed = False
    load_start = load_average()
    for name in args.models:
        spec = MODELS[name]
        path, reason = model_path(spec, args.nudenet, out)
        if path is None:
            print(f"[{name}] skipped: {reason}", file=sys.stderr)
            rows.append(Row(name, spec.description, status="skipped", reason=reason))
            continue
        try:
            target = args.target or default_target(path)
            rows.append(bench_model(spec, path, target, args.repeat, out, bisect_argv))
        except Exception as exc:  # a measurement failed; report it and go on
            failed = True
            reason = f"{type(exc).__name__}: {exc}"
            print(f"[{name}] error: {reason}", file=sys.stderr)
            rows.append(Row(name, spec.description, path=str(path), status="error", reason=reason))

    load_end = load_average()
    print()
    print(render_table(rows))
    print(f"\n1-min load average: {load_start} at start, {load_end} at end ({os.cpu_count()} CPUs)")
    doc = {
        "schema": "onnx-bisect-bench/1",
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *sys.argv]),
        "repeat": args.repeat,
        "targets": {
            "ratio_max": TARGET_RATIO,
            "speedup_min": TARGET_SPEEDUP,
            "rss_mb_max": TARGET_RSS_MB,
        },
        "environment": environment(),
        "load_average_1min": {"start": load_start, "end": load_end},
        "rows": [r.to_dict() for r in rows],
    }
    (out / "bench.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(f"written {out / 'bench.json'}; logs under {out}/<model>/logs/")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
