#!/usr/bin/env python3
"""Reproduce a numeric divergence between two ONNX backends on one small subgraph.

__TITLE__
Written by onnx-bisect. The bundle, next to this script:

    model.onnx                    the subgraph
    test_data_set_0/input_N.pb    its inputs: the reference's tensors at the cut
    test_data_set_0/output_N.pb   the reference's outputs: what a correct runtime returns

Usage:

    python repro.py                   run the recorded target, compare with output_N.pb
    python repro.py --target SPEC     another target (after a fix, or "cpu?opt=disable")
    python repro.py --ref SPEC        another live reference for the sanity line ("ref")
    python repro.py --dir DIR         the bundle in DIR rather than this script's directory
    python repro.py --timeout SEC     a target that runs longer counts as a crash (0: never)

--metric, --threshold, --atol, --rtol and --precision override the recorded divergence
criterion; with a precision (float16, bfloat16, tf32), values it holds that come back 0 (a
flush) are a divergence too.

The target runs in a child process, so that a segfault, an abort or a hang is reported rather
than taking this script down. The reference runs in this process; its line only checks that
the recorded outputs still hold on this machine.

Backend specs (quote them in the shell):

    cpu, cuda, tensorrt, coreml, dml, rocm       ONNX Runtime with that execution provider
    ort[:DEVICE][?opt=disable|basic|extended|all&disable=A,B&threads=N]
    ref                                          onnx.reference.ReferenceEvaluator
    openvino[:CPU|GPU|NPU][?precision=f32|bf16|f16]
    exec:COMMAND                                 any program, see below
    dump:PATH                                    tensors recorded earlier, see below
    mps, plugins, ref?dtype=float64              through onnx-bisect, where it is installed

exec:COMMAND is split like a shell would and run without one, with {model}, {inputs} and
{outputs} replaced by paths: the model, an .npz of the inputs keyed by graph input name, and
the .npz of outputs keyed by graph output name that the program must write; {python} is the
interpreter running this script.

dump:PATH replays tensors recorded earlier (what `onnx-bisect dump` writes: NAME.npy files with
the name percent-encoded; or .pb TensorProtos carrying their names; or one .npz). A relative
PATH is read from the bundle's directory: a reference that was a dump is recorded as
dump:test_data_set_0, the bundle's own expected outputs, so the bundle needs no other files.

Exit codes: 1 the recorded symptom (a divergence, a crash, or the target's error) reproduces,
0 it does not, 2 a usage error or a target that reports an error where the recorded symptom is
a divergence or a crash.
Needs numpy, onnx and the packages of the runtimes used, nothing else.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import importlib
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import urllib.parse
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:
    import numpy as np
    import onnx
    from onnx import numpy_helper
except ImportError as _exc:
    sys.stderr.write(f"error: repro.py needs numpy and onnx ({_exc}); pip install numpy onnx\n")
    raise SystemExit(2) from None

# What onnx-bisect compared, and what it called a divergence: it wrote these values over the
# quoted placeholders of its template (onnx_bisect/repro/template.py) when it made the bundle.
REF = "__REF__"
TARGET = "__TARGET__"
METRIC = "__METRIC__"
THRESHOLD = "__THRESHOLD__"
# With ATOL or RTOL set, any element outside np.isclose(target, expected) is a divergence.
ATOL = "__ATOL__"
RTOL = "__RTOL__"
# Where onnx-bisect ran (None: not recorded): exec: commands may hold paths relative to it.
WORKDIR: str | None = "__WORKDIR__"
# What this bundle reproduces: "divergence", "crash", or "error" (the target reports an error,
# such as a missing kernel, on this subgraph).
SYMPTOM = "__SYMPTOM__"
# The precision the target computes in where it was declared lower (float16, bfloat16, tf32),
# else None: then values that precision holds coming back 0 (a flush) are a divergence however
# small the metric, and THRESHOLD is that precision's bound, not float32's.
PRECISION: str | None = "__PRECISION__"

DEFAULT_TIMEOUT = 600.0

Tensors = dict[str, Any]
Runner = Callable[[Path, onnx.ModelProto, Tensors], Tensors]

# onnx-bisect's own tables, restated so that this script runs without it.
ALIASES = {
    "cpu": ("ort", "cpu"),
    "cuda": ("ort", "cuda"),
    "tensorrt": ("ort", "tensorrt"),
    "trt": ("ort", "tensorrt"),
    "coreml": ("ort", "coreml"),
    "dml": ("ort", "dml"),
    "rocm": ("ort", "rocm"),
    "onnxruntime": ("ort", "cpu"),
    "mps": ("torch", "mps"),
}
PROVIDERS = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
    "coreml": "CoreMLExecutionProvider",
    "dml": "DmlExecutionProvider",
    "rocm": "ROCMExecutionProvider",
    "openvino": "OpenVINOExecutionProvider",
}
OPT_LEVELS = ("disable", "basic", "extended", "all")
PRECISIONS = {"f32": "f32", "fp32": "f32", "bf16": "bf16", "f16": "f16", "fp16": "f16"}
PLACEHOLDERS = ("{model}", "{inputs}", "{outputs}")
# Per lower precision: its largest finite value and its smallest positive one.
FORMATS = {
    "float16": (65504.0, 5.960464477539063e-08),
    "bfloat16": (3.3895313892515355e38, 9.2e-41),
    "tf32": (3.4028234663852886e38, 1.4e-45),
}
# A zero counts as flushed where the expected value is at least this many of the format's
# smallest steps, and the zeros must be nearly all (FLUSH_BAND) of the values up to their size.
FLUSH_ULPS = 16
FLUSH_BAND = 0.9
_HIGHER_IS_WORSE = {
    "rel_l2": True,
    "max_abs": True,
    "mean_abs": True,
    "cosine": False,
    "sqnr_db": False,
}
_SPEC = re.compile(r"^(?P<name>[A-Za-z_][\w.-]*)(?::(?P<device>[^?+]*))?(?:\?(?P<query>[^+]*))?$")
# A plugin by file, `path/to/file.py:Class?k=v`: the path may hold any character but '?'.
_FILE_SPEC = re.compile(r"^(?P<path>[^?]+\.py):(?P<cls>[A-Za-z_]\w*)(?:\?(?P<query>.*))?$")
# How the child tells the parent what went wrong, on its last stderr line.
_CHILD_USAGE = "repro-child-usage-error: "
_CHILD_FAILURE = "repro-child-failure: "
_STDERR_TAIL = 5


class UsageError(Exception):
    """The bundle, a spec or the environment is unusable: one line on stderr, exit code 2."""


class RunError(Exception):
    """A backend did not produce outputs. ``crash``: it died or hung rather than reporting."""

    def __init__(self, message: str, *, crash: bool = False, stderr: str = "") -> None:
        super().__init__(message)
        self.crash = crash
        self.stderr = stderr


# ---------------------------------------------------------------------------------------------
# Backend specs


@dataclass(frozen=True)
class Spec:
    text: str
    name: str
    device: str | None = None
    options: Mapping[str, str] = field(default_factory=dict)
    transforms: tuple[str, ...] = ()


def parse_spec(text: str) -> Spec:
    """NAME[:DEVICE][?key=value&...][+TRANSFORM...] or exec:COMMAND, as onnx-bisect reads it."""
    raw = text.strip()
    if not raw:
        raise UsageError("empty backend spec; try 'cpu', 'ref' or 'openvino'")
    for verbatim in ("exec", "dump"):
        if raw.startswith(f"{verbatim}:"):
            return Spec(raw, verbatim, raw[len(verbatim) + 1 :].strip())
    plugin = _FILE_SPEC.match(raw)
    if plugin:
        # Built by onnx-bisect itself (``_plugin_runner``), which reads the options.
        return Spec(raw, "file", f"{plugin['path']}:{plugin['cls']}")
    head, *transforms = raw.split("+")
    m = _SPEC.match(head)
    if not m:
        raise UsageError(f"cannot parse backend spec {text!r}; expected NAME[:DEVICE][?key=value]")
    name, device = m["name"].lower(), m["device"] or None
    if name in ALIASES:
        if device is not None:
            raise UsageError(f"backend {raw!r}: alias {name!r} already names a device")
        name, device = ALIASES[name]
    options: dict[str, str] = {}
    for part in filter(None, (m["query"] or "").split("&")):
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"backend {raw!r}: option {part!r} must look like key=value")
        options[key.strip()] = value.strip()
    if device and "." not in name:
        device = device.lower()
    extra = tuple(t.strip() for t in transforms if t.strip())
    return Spec(raw, name, device, options, extra)


def check_spec(spec: Spec) -> None:
    """Reject what cannot work before anything runs; plugin specs are checked when built."""
    if spec.transforms:
        raise UsageError(
            f"backend {spec.text!r}: model transforms (+{', +'.join(spec.transforms)}) "
            "are not supported"
        )
    if spec.name == "ort":
        _check_options(spec, ("opt", "disable", "threads"))
        if (spec.device or "cpu") not in PROVIDERS:
            raise UsageError(
                f"backend {spec.text!r}: unknown device {spec.device!r}; "
                f"choose from {', '.join(PROVIDERS)}"
            )
        if spec.options.get("opt", "all") not in OPT_LEVELS:
            raise UsageError(f"backend {spec.text!r}: opt must be one of {', '.join(OPT_LEVELS)}")
        if not re.fullmatch(r"\d+", spec.options.get("threads", "0")):
            raise UsageError(f"backend {spec.text!r}: threads must be a non-negative integer")
    elif spec.name == "ref":
        _check_options(spec, ("dtype",))
        if spec.options.get("dtype", "float32") not in ("float32", "float64"):
            raise UsageError(
                f"backend {spec.text!r}: dtype must be float32 (the default) or float64"
            )
    elif spec.name == "openvino":
        _check_options(spec, ("precision",))
        precision = spec.options.get("precision")
        if precision is not None and precision.lower() not in PRECISIONS:
            raise UsageError(f"backend {spec.text!r}: precision must be f32, bf16 or f16")
    elif spec.name == "dump" and not spec.device:
        raise UsageError(f"backend {spec.text!r}: dump: needs a path, e.g. dump:DIR")
    elif spec.name == "exec":
        try:
            argv = shlex.split(spec.device or "")
        except ValueError as exc:
            raise UsageError(f"backend {spec.text!r}: cannot split the command ({exc})") from None
        missing = [p for p in PLACEHOLDERS if p not in (spec.device or "")]
        if not argv or missing:
            raise UsageError(
                f"backend {spec.text!r}: the command must contain {' '.join(PLACEHOLDERS)}, "
                "e.g. exec:./myrt {model} {inputs} {outputs}"
            )


def _check_options(spec: Spec, allowed: tuple[str, ...]) -> None:
    unknown = sorted(set(spec.options) - set(allowed))
    if unknown:
        raise UsageError(
            f"backend {spec.text!r}: unknown option(s) {', '.join(unknown)}; "
            f"valid: {', '.join(allowed)}"
        )


def _import(module: str, spec: Spec, hint: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise UsageError(
            f"backend {spec.text!r} needs the {module} package, which does not import here "
            f"({_one_line(exc)}); {hint}"
        ) from None


# ---------------------------------------------------------------------------------------------
# Runners: each returns the model's outputs by graph output name


def make_runner(spec: Spec, timeout: float | None) -> Runner:
    """Check that ``spec`` can run here (imports, devices) and return what runs it."""
    check_spec(spec)
    builders: dict[str, Callable[[Spec], Runner]] = {
        "ort": _ort_runner,
        "ref": _ref_runner,
        "openvino": _openvino_runner,
    }
    if spec.name == "exec":
        return _exec_runner(spec, timeout)
    if spec.name == "dump":
        return _dump_runner(spec)
    if spec.name in builders:
        return builders[spec.name](spec)
    return _plugin_runner(spec)


def _ort_runner(spec: Spec) -> Runner:
    ort = _import("onnxruntime", spec, "pip install onnxruntime (or the build for your device)")
    provider = PROVIDERS[spec.device or "cpu"]
    available = ort.get_available_providers()
    if provider not in available:
        raise UsageError(
            f"backend {spec.text!r}: this onnxruntime {ort.__version__} build has no {provider} "
            f"(available: {', '.join(available)}); install the onnxruntime package for it"
        )
    # Nodes the provider does not take run on the CPU, as in a deployment.
    cpu = PROVIDERS["cpu"]
    providers = [provider] if provider == cpu else [provider, cpu]
    level = {
        "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }[spec.options.get("opt", "all")]
    disabled = [d for d in spec.options.get("disable", "").split(",") if d]
    threads = int(spec.options.get("threads", "0"))

    def run(model_path: Path, model: onnx.ModelProto, feeds: Tensors) -> Tensors:
        options = ort.SessionOptions()
        options.graph_optimization_level = level
        options.log_severity_level = 4  # errors come back as exceptions; no native log lines
        if threads:
            options.intra_op_num_threads = threads
        kwargs: dict[str, Any] = {"providers": providers}
        if disabled:
            # ONNX Runtime silently ignores optimizer names it does not know.
            kwargs["disabled_optimizers"] = disabled
        try:
            session = ort.InferenceSession(str(model_path), options, **kwargs)
        except Exception as exc:
            # onnx saves newer IR versions than an installed onnxruntime may read; a copy that
            # declares the highest it reads runs when the model's opsets allow it.
            copy = _lowered_ir(model, str(exc), f"onnxruntime {ort.__version__}")
            if copy is None:
                raise
            # Given as bytes, the copy finds its weights (model.onnx.data) beside the bundle's.
            folder = str(model_path.parent.resolve())
            options.add_session_config_entry(_WEIGHTS_FOLDER, folder)
            session = ort.InferenceSession(copy.SerializeToString(), options, **kwargs)
        names = [o.name for o in session.get_outputs()]
        wanted = {i.name for i in session.get_inputs()}
        values = session.run(names, {k: v for k, v in feeds.items() if k in wanted})
        return dict(zip(names, values, strict=True))

    return run


_WEIGHTS_FOLDER = "session.model_external_initializers_file_folder_path"
_IR_REFUSED = re.compile(r"Unsupported model IR version: (\d+), max supported IR version: (\d+)")


def _lowered_ir(model: onnx.ModelProto, error: str, runtime: str) -> onnx.ModelProto | None:
    """A copy of ``model`` at the IR version the runtime's ``error`` says it reads, when the
    model's ONNX opsets need no more; None otherwise."""
    match = _IR_REFUSED.search(error)
    if match is None:
        return None
    highest = int(match.group(2))
    known = {d for d, _ in onnx.helper.OP_SET_ID_VERSION_MAP}
    opsets = [o for o in model.opset_import if (o.domain or "ai.onnx") in known]
    try:
        needed = onnx.helper.find_min_ir_version_for(opsets) if opsets else 3
    except ValueError:
        return None
    if needed > highest:
        return None
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    copy.ir_version = highest
    print(
        f"note: {runtime} reads IR versions up to {highest}; ran a copy "
        f"of model.onnx lowered from IR {model.ir_version}",
        file=sys.stderr,
    )
    return copy


def _ref_runner(spec: Spec) -> Runner:
    upcast: tuple[Callable[..., Any], Callable[..., Any]] | None = None
    if spec.options.get("dtype") == "float64":
        try:
            from onnx_bisect.transforms.upcast import upcast_feeds, upcast_model
        except Exception:
            raise UsageError(
                f"backend {spec.text!r} needs onnx-bisect (pip install onnx-bisect) to upcast "
                "the model to float64; plain 'ref' runs without it"
            ) from None
        upcast = (upcast_model, upcast_feeds)

    # The tool's 'ref' corrects operators onnx.reference computes wrongly (BatchNormalization
    # at opsets 9-13 runs in training mode upstream); without them this script would compare
    # against a different reference than the report did.
    corrections: list[Any] | None = None
    try:
        from onnx_bisect.backends.reference_ops import NEW_OPS

        corrections = list(NEW_OPS)
    except Exception:
        print(
            "warning: onnx-bisect is not installed, so 'ref' is plain onnx.reference without "
            "the tool's corrections (BatchNormalization at opsets 9-13, Erf)",
            file=sys.stderr,
        )

    def run(model_path: Path, model: onnx.ModelProto, feeds: Tensors) -> Tensors:
        from onnx.reference import ReferenceEvaluator

        if any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer):
            # The evaluator reads weights from the message: model.onnx.data is loaded.
            model = onnx.load(str(model_path))
        if upcast is not None:
            model, feeds = upcast[0](model), upcast[1](feeds)
        evaluator = ReferenceEvaluator(model, new_ops=corrections)
        names = [o.name for o in model.graph.output]
        wanted = set(evaluator.input_names)
        values = evaluator.run(names, {k: v for k, v in feeds.items() if k in wanted})
        return dict(zip(names, values, strict=True))

    return run


def _openvino_runner(spec: Spec) -> Runner:
    ov = _import("openvino", spec, "pip install openvino")
    core = ov.Core()
    device = (spec.device or "CPU").upper()
    devices = list(core.available_devices)
    if not any(d.split(".")[0] == device for d in devices):
        raise UsageError(
            f"backend {spec.text!r}: OpenVINO has no {device} device here "
            f"(available: {', '.join(devices)})"
        )
    precision = spec.options.get("precision")
    config = {"INFERENCE_PRECISION_HINT": PRECISIONS[precision.lower()]} if precision else {}

    def run(model_path: Path, model: onnx.ModelProto, feeds: Tensors) -> Tensors:
        ov_model = core.read_model(str(model_path))
        wanted = {p.get_any_name() for p in ov_model.inputs}
        feeds = {k: v for k, v in feeds.items() if k in wanted}
        # Static shapes, as a deployment would compile them.
        ov_model.reshape({k: list(np.shape(v)) for k, v in feeds.items()})
        compiled = core.compile_model(ov_model, device, config)
        results = compiled.create_infer_request().infer(feeds)
        names = [o.name for o in model.graph.output]
        out: Tensors = {}
        for i, port in enumerate(compiled.outputs):
            value = np.array(results[port])
            for name in port.get_names():
                out[name] = value
            # OpenVINO may rename an output; its position still holds.
            if i < len(names) and names[i] not in out:
                out[names[i]] = value
        return out

    return run


def _exec_runner(spec: Spec, timeout: float | None) -> Runner:
    command = spec.device or ""
    argv = shlex.split(command)

    def run(model_path: Path, model: onnx.ModelProto, feeds: Tensors) -> Tensors:
        with tempfile.TemporaryDirectory(prefix="repro-exec-", ignore_cleanup_errors=True) as tmp:
            paths = {
                "{model}": str(model_path.resolve()),
                "{inputs}": str(Path(tmp) / "inputs.npz"),
                "{outputs}": str(Path(tmp) / "outputs.npz"),
                # The interpreter running this script, as {python} was onnx-bisect's own.
                "{python}": sys.executable,
            }
            save_npz(Path(paths["{inputs}"]), {k: feeds[k] for k in feed_names(model)})
            args = [_substitute(a, paths) for a in argv]
            workdir = WORKDIR if WORKDIR and Path(WORKDIR).is_dir() else None
            code, stderr = run_process(args, timeout, cwd=workdir)
            if code != 0:
                raise _exit_error(code, stderr)
            out = Path(paths["{outputs}"])
            if not out.is_file():
                raise RunError(f"exited 0 but wrote no {out.name}: {_tail(stderr)}")
            return load_npz(out)

    return run


def _dump_runner(spec: Spec) -> Runner:
    def run(model_path: Path, model: onnx.ModelProto, feeds: Tensors) -> Tensors:
        # Relative to the bundle, so that a bundle and the dump inside it travel together.
        path = model_path.parent / (spec.device or "")
        if not path.exists():
            raise UsageError(f"backend {spec.text!r}: no dump at {path}")
        recorded = read_dump(path)
        outputs = [o.name for o in model.graph.output]
        missing = [n for n in outputs if n not in recorded]
        if missing:
            raise RunError(f"the dump at {path} holds no tensor {missing[0]!r}")
        return {n: recorded[n] for n in outputs}

    return run


def read_dump(path: Path) -> Tensors:
    """Every tensor of a dump, by name (as onnx-bisect's dump: backend reads one)."""
    if path.is_file():
        return load_npz(path)
    found: Tensors = {}
    for f in sorted(path.glob("*.npy")):
        found[urllib.parse.unquote(f.name.removesuffix(".npy"))] = np.load(f, allow_pickle=False)
    for f in sorted(path.glob("*.pb")):
        proto = onnx.TensorProto()
        proto.ParseFromString(f.read_bytes())
        if proto.name:
            found[proto.name] = numpy_helper.to_array(proto)
    for f in sorted(path.glob("*.npz")):
        if f.name != "inputs.npz":
            found.update(load_npz(f))
    return found


def _plugin_runner(spec: Spec) -> Runner:
    try:
        from onnx_bisect.backends.registry import create_backend
    except Exception:
        raise UsageError(
            f"backend {spec.text!r} is not one this script runs by itself (cpu, ort, ref, "
            "openvino, exec:); it needs onnx-bisect and the plugin that provides it "
            "(pip install onnx-bisect), or pass another --target/--ref"
        ) from None
    try:
        backend = create_backend(_plugin_text(spec))
    except Exception as exc:
        raise UsageError(_one_line(exc)) from None

    def run(model_path: Path, model: onnx.ModelProto, feeds: Tensors) -> Tensors:
        return dict(backend.run(model, feeds))

    return run


def _plugin_text(spec: Spec) -> str:
    """The spec, with a plugin file's relative path taken from where onnx-bisect ran when it
    is not found from here (as exec: commands run there)."""
    if spec.name != "file":
        return spec.text
    path = (spec.device or "").rsplit(":", 1)[0]
    there = Path(WORKDIR or ".") / path
    if Path(path).is_absolute() or Path(path).exists() or not there.exists():
        return spec.text
    return str(there) + spec.text[len(path) :]


def _substitute(arg: str, paths: Mapping[str, str]) -> str:
    for key, value in paths.items():
        arg = arg.replace(key, value)
    return arg


# ---------------------------------------------------------------------------------------------
# Processes


def run_process(argv: list[str], timeout: float | None, cwd: str | None = None) -> tuple[int, str]:
    """Run ``argv`` in its own process group; returns (exit status, stderr)."""
    try:
        proc = subprocess.Popen(
            argv,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            # A group, so that a timeout also kills what the program started.
            start_new_session=True,
        )
    except FileNotFoundError:
        raise UsageError(f"command not found: {argv[0]}") from None
    except OSError as exc:
        raise UsageError(f"cannot run {argv[0]}: {exc.strerror or exc}") from None
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill(proc)
        raise RunError(
            f"timed out after {timeout:g} s and was killed (a hang; raise --timeout if it is "
            "only slow)",
            crash=True,
        ) from None
    finally:
        if proc.poll() is None:
            _kill(proc)
    return proc.returncode, err.decode("utf-8", errors="replace")


def _kill(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if os.name == "posix":
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
    # A grandchild in a session of its own may still hold the pipe: do not wait for it.
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.communicate(timeout=5)


def _exit_error(code: int, stderr: str) -> RunError:
    if code < 0:
        try:
            name = f" ({signal.Signals(-code).name})"
        except ValueError:
            name = ""
        detail = _tail(stderr) if stderr.strip() else ""
        return RunError(f"killed by signal {-code}{name}", crash=True, stderr=detail)
    return RunError(f"exited with code {code}: {_tail(stderr)}")


def _tail(stderr: str) -> str:
    """The last lines of stderr, or where a Python process died, from faulthandler's report."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    for i, line in enumerate(lines):
        if line.startswith("Fatal Python error"):
            # Its innermost frames come first; the end lists extension modules.
            return " | ".join(lines[i : i + _STDERR_TAIL + 1])
    return " | ".join(lines[-_STDERR_TAIL:]) or "(no stderr)"


def run_target_in_child(spec: Spec, directory: Path, timeout: float | None) -> Tensors:
    """Run ``spec`` on the bundle in a fresh ``python repro.py --_child-target`` process."""
    with tempfile.TemporaryDirectory(prefix="repro-target-", ignore_cleanup_errors=True) as tmp:
        out = Path(tmp) / "outputs.npz"
        argv = [
            sys.executable,
            str(Path(__file__).resolve()),
            f"--_child-target={spec.text}",
            f"--dir={directory.resolve()}",
            f"--out={out}",
        ]
        code, stderr = run_process(argv, timeout)
        lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
        last = lines[-1] if lines else ""
        if code == 2 and last.startswith(_CHILD_USAGE):
            raise UsageError(last[len(_CHILD_USAGE) :])
        if code == 3 and last.startswith(_CHILD_FAILURE):
            raise RunError(last[len(_CHILD_FAILURE) :])
        if code != 0:
            error = _exit_error(code, stderr)
            error.crash = True  # not an error the runtime reported: the process went down
            raise error
        if not out.is_file():
            raise RunError(f"the child process wrote no outputs: {_tail(stderr)}", crash=True)
        return load_npz(out)


def child_main(spec_text: str, directory: Path, out: Path) -> int:
    # A segfault then leaves a Python traceback in the stderr tail the parent reports.
    faulthandler.enable()
    try:
        runner = make_runner(parse_spec(spec_text), None)
        bundle = load_bundle(directory)
        save_npz(out, runner(bundle.model_path, bundle.model, bundle.inputs))
    except UsageError as exc:
        print(f"{_CHILD_USAGE}{exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        # Whole, on one line: the runtime's message is the finding when it is the symptom.
        print(
            f"{_CHILD_FAILURE}{' '.join(str(exc).split()) or type(exc).__name__}", file=sys.stderr
        )
        return 3
    return 0


# ---------------------------------------------------------------------------------------------
# The bundle


@dataclass(frozen=True)
class Bundle:
    model_path: Path
    model: onnx.ModelProto
    inputs: Tensors
    expected: Tensors


def feed_names(model: onnx.ModelProto) -> list[str]:
    """Graph inputs that need a value: those with an initializer have one already."""
    inits = {t.name for t in model.graph.initializer}
    return [i.name for i in model.graph.input if i.name not in inits]


def load_bundle(directory: Path) -> Bundle:
    model_path = directory / "model.onnx"
    if not model_path.is_file():
        raise UsageError(
            f"no model.onnx in {directory}; run the repro.py of a bundle, or pass --dir BUNDLE"
        )
    try:
        # Weights stay in model.onnx.data, if any, for the runtimes to read from the file.
        model = onnx.load(str(model_path), load_external_data=False)
    except Exception as exc:
        raise UsageError(f"{model_path} is not a readable ONNX model ({_one_line(exc)})") from None
    data = directory / "test_data_set_0"
    if not data.is_dir():
        raise UsageError(f"no test_data_set_0 directory in {directory}; the bundle is incomplete")
    inits = {t.name for t in model.graph.initializer}
    names = feed_names(model)
    inputs = _read_tensors(data, "input", names, inits)
    missing = [n for n in names if n not in inputs]
    if missing:
        raise UsageError(f"{data} has no input_N.pb for graph input(s) {', '.join(missing)}")
    for vi in model.graph.input:
        if vi.name in inputs:
            _check_input(vi, inputs[vi.name])
    outputs = [o.name for o in model.graph.output]
    # None recorded (a bundle for a crash may have none): the live reference stands in.
    expected = _read_tensors(data, "output", outputs, set())
    return Bundle(model_path, model, inputs, expected)


def _check_input(vi: onnx.ValueInfoProto, value: Any) -> None:
    """A tensor the model cannot take is a broken bundle, not a runtime failing."""
    tt = vi.type.tensor_type
    if tt.elem_type:
        want = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type)
        if value.dtype != want:
            raise UsageError(f"input {vi.name!r} is {value.dtype} but the model takes {want}")
    if tt.HasField("shape"):
        dims = [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim]
        fits = len(dims) == value.ndim
        fits = fits and all(d is None or d == n for d, n in zip(dims, value.shape, strict=False))
        if not fits:
            shown = ", ".join("?" if d is None else str(d) for d in dims)
            raise UsageError(
                f"input {vi.name!r} has shape {tuple(value.shape)} but the model takes [{shown}]"
            )


def _read_tensors(data: Path, kind: str, names: list[str], skip: set[str]) -> Tensors:
    """``{kind}_N.pb`` in numeric order, matched by TensorProto name, else N is the position."""
    found: list[tuple[int, Path]] = []
    for path in data.glob(f"{kind}_*.pb"):
        m = re.fullmatch(rf"{kind}_(\d+)\.pb", path.name)
        if m:
            found.append((int(m[1]), path))
    tensors: Tensors = {}
    for position, path in sorted(found):
        proto = onnx.TensorProto()
        try:
            proto.ParseFromString(path.read_bytes())
            value = numpy_helper.to_array(proto)
        except Exception as exc:
            raise UsageError(f"{path} is not a readable TensorProto ({_one_line(exc)})") from None
        if proto.name in skip:
            continue  # a graph input that an initializer already provides
        if proto.name in names:
            tensors[proto.name] = value
        elif position < len(names):
            tensors[names[position]] = value
        else:
            raise UsageError(
                f"{path} (name {proto.name!r}) matches no graph {kind}; "
                f"the model's are {', '.join(names) or 'none'}"
            )
    return tensors


def save_npz(path: Path, tensors: Mapping[str, Any]) -> None:
    """Entry by entry: ``np.savez(**tensors)`` would swallow a tensor named ``file``."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name, value in tensors.items():
            with zf.open(f"{name}.npy", "w", force_zip64=True) as f:
                np.lib.format.write_array(f, np.asarray(value), allow_pickle=False)


def load_npz(path: Path) -> Tensors:
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except Exception as exc:
        raise RunError(f"cannot read {path.name} ({_one_line(exc)})") from None


# ---------------------------------------------------------------------------------------------
# Comparison


@dataclass(frozen=True)
class Criterion:
    metric: str
    threshold: float
    atol: float | None
    rtol: float | None
    precision: str | None = None

    @property
    def allclose(self) -> bool:
        return self.atol is not None or self.rtol is not None

    @property
    def tolerances(self) -> tuple[float, float]:
        """(atol, rtol); the one not given takes onnx-bisect's default."""
        return (1e-5 if self.atol is None else self.atol, 1e-3 if self.rtol is None else self.rtol)

    def describe(self) -> str:
        if self.allclose:
            atol, rtol = self.tolerances
            return f"allclose(atol={atol:g}, rtol={rtol:g})"
        op = ">" if _HIGHER_IS_WORSE[self.metric] else "<"
        return f"{self.metric} {op} {self.threshold:g}"

    def agreement(self) -> str:
        """When an output agrees: the negation of describe(), which read as the failing test
        when said of outputs that agree. ASCII, as all of this script prints."""
        if self.allclose:
            return self.describe()
        op = "<=" if _HIGHER_IS_WORSE[self.metric] else ">="
        return f"{self.metric} {op} {self.threshold:g}"

    def fails(self, value: float) -> bool:
        if value != value:  # NaN
            return True
        if _HIGHER_IS_WORSE[self.metric]:
            return value > self.threshold
        return value < self.threshold


@dataclass(frozen=True)
class Row:
    name: str
    diverged: bool
    metrics: dict[str, float]
    reason: str = ""


def _kind(a: Any) -> str:
    dtype: np.dtype[Any] = a.dtype
    if dtype.kind == "f" or dtype.name.startswith(("float", "bfloat")):
        return "float"
    return {"b": "bool", "i": "int", "u": "int"}.get(dtype.kind, dtype.name)


def metrics(ref: Any, target: Any) -> dict[str, float]:
    """All metrics in float64. Relative error is a ratio of norms: never divide by |ref|."""
    r = np.asarray(ref, dtype=np.float64).ravel()
    t = np.asarray(target, dtype=np.float64).ravel()
    if r.size == 0:
        return {
            "rel_l2": 0.0,
            "max_abs": 0.0,
            "mean_abs": 0.0,
            "cosine": 1.0,
            "sqnr_db": float("inf"),
        }
    d = np.abs(t - r)
    nd, nr, nt = (float(np.linalg.norm(x)) for x in (d, r, t))
    if nr == 0.0 and nt == 0.0:
        cos = 1.0
    elif nr == 0.0 or nt == 0.0:
        cos = 0.0
    else:
        cos = float(np.dot(r, t)) / (nr * nt)
    if nd == 0.0:
        sqnr = float("inf")
    elif nr == 0.0:
        sqnr = float("-inf")
    else:
        sqnr = 20.0 * float(np.log10(nr / nd))
    return {
        "rel_l2": nd / nr if nr else nd,
        "max_abs": float(d.max()),
        "mean_abs": float(d.mean()),
        "cosine": cos,
        "sqnr_db": sqnr,
    }


def compare(name: str, expected: Any, actual: Any | None, crit: Criterion) -> Row:
    """One output against its expected value. Integers and booleans must match exactly, NaN and
    Inf must sit at the same places, and a shape or dtype-kind mismatch is a divergence."""
    if actual is None:
        return Row(name, True, {}, "missing from the target's outputs")
    e, a = np.asarray(expected), np.asarray(actual)
    if e.shape != a.shape:
        return Row(name, True, {}, f"shape {tuple(a.shape)} != expected {tuple(e.shape)}")
    ke, ka = _kind(e), _kind(a)
    if ke != ka:
        return Row(name, True, {}, f"dtype {a.dtype} != expected {e.dtype}")
    if ke != "float":
        values = metrics(e, a) if ke in ("int", "bool") else {}
        differ = int(np.count_nonzero(e != a))
        if differ:
            return Row(name, True, values, f"{differ} of {e.size} {e.dtype} elements differ")
        return Row(name, False, values)
    r, t = np.asarray(e, dtype=np.float64).ravel(), np.asarray(a, dtype=np.float64).ravel()
    bad = (np.isnan(r) != np.isnan(t)) | (np.isinf(r) != np.isinf(t))
    bad |= np.isinf(r) & np.isinf(t) & (np.sign(r) != np.sign(t))
    keep = np.isfinite(r) & np.isfinite(t)
    r, t = r[keep], t[keep]
    values = metrics(r, t)
    nonfinite = int(np.count_nonzero(bad))
    if nonfinite:
        return Row(name, True, values, f"{nonfinite} NaN/Inf values differ from the expected")
    flush = flushed(r, t, crit.precision) if crit.precision in FORMATS else ""
    if flush:
        return Row(name, True, values, flush)
    if crit.allclose:
        atol, rtol = crit.tolerances
        close = np.isclose(t, r, rtol=rtol, atol=atol)
        far = int(close.size - np.count_nonzero(close))
        values["mismatch"] = far / close.size if close.size else 0.0
        if far:
            return Row(name, True, values, f"{far} of {close.size} outside {crit.describe()}")
        return Row(name, False, values)
    if crit.fails(values[crit.metric]):
        return Row(name, True, values, crit.describe())
    return Row(name, False, values)


def flushed(r: Any, t: Any, precision: str) -> str:
    """Values ``precision`` holds that came back 0, when they are at least 1% of the elements
    (and 8) and nearly all of the values up to their size: a flush, not rounding ("" if not).
    onnx-bisect's range test (compare/precision.py), restated."""
    largest, tiny = FORMATS[precision]
    size = np.abs(r)
    nonzero = size[size > 0]
    typical = float(np.median(nonzero)) if nonzero.size else 0.0
    smallest = max(FLUSH_ULPS * tiny, 1e-6 * typical)
    held = (size >= smallest) & (size <= largest)
    zero = held & (t == 0)
    count = int(np.count_nonzero(zero))
    if not r.size or count < max(8, 0.01 * r.size):
        return ""
    zeroed = size[zero]
    edge = float(np.quantile(zeroed, 0.9))
    up_to = int(np.count_nonzero(held & (size <= edge)))
    if int(np.count_nonzero(zeroed <= edge)) < FLUSH_BAND * up_to:
        return ""
    share, most = 100 * count / r.size, float(zeroed.max())
    return f"{share:.1f}% of the elements are 0 where {precision} holds values up to {most:.2g}"


def compare_all(expected: Tensors, actual: Tensors, crit: Criterion) -> list[Row]:
    return [compare(n, v, actual.get(n), crit) for n, v in expected.items()]


def _fmt(value: float, digits: int = 3) -> str:
    return f"{value:.{digits}g}"


def _row_line(row: Row, width: int, crit: Criterion) -> str:
    shown = ["rel_l2", "max_abs", "cosine"]
    if crit.allclose:
        shown.append("mismatch")
    elif crit.metric not in shown:
        shown.append(crit.metric)
    parts = [
        f"{k}={_fmt(row.metrics[k], 6 if k == 'cosine' else 3)}" for k in shown if k in row.metrics
    ]
    verdict = f"DIVERGED ({row.reason})" if row.diverged else "ok"
    return "  ".join([f"  {row.name:<{width}}", *parts, verdict])


def _summary(rows: list[Row], crit: Criterion) -> str:
    """One phrase for the reference line: the worst value of the deciding number."""
    bad = [r for r in rows if r.diverged]
    if bad:
        return f"DIFFERS from the expected outputs ({bad[0].name}: {bad[0].reason})"
    key = "mismatch" if crit.allclose else crit.metric
    values = [r.metrics[key] for r in rows if key in r.metrics]
    if not values:
        return "matches expected outputs"
    worst = min(values) if not crit.allclose and not _HIGHER_IS_WORSE[key] else max(values)
    return f"matches expected outputs ({key} {_fmt(worst)})"


# ---------------------------------------------------------------------------------------------
# Command line


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:500] or type(exc).__name__


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="repro.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    here = Path(__file__).resolve().parent
    shown = "default: %(default)s"  # argparse fills it in, safely for any spec text
    p.add_argument("--target", metavar="SPEC", default=TARGET, help=shown)
    p.add_argument("--ref", metavar="SPEC", default=REF, help=shown)
    p.add_argument("--dir", metavar="DIR", type=Path, default=here, help=shown)
    p.add_argument("--timeout", metavar="SECONDS", type=float, default=DEFAULT_TIMEOUT, help=shown)
    p.add_argument("--metric", choices=sorted(_HIGHER_IS_WORSE), default=METRIC, help=shown)
    p.add_argument("--threshold", metavar="X", type=float, default=THRESHOLD, help=shown)
    p.add_argument("--atol", metavar="X", type=float, default=ATOL, help=shown)
    p.add_argument("--rtol", metavar="X", type=float, default=RTOL, help=shown)
    p.add_argument("--precision", choices=sorted(FORMATS), default=PRECISION, help=shown)
    p.add_argument("--_child-target", dest="child_target", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.child_target is not None:
        if args.out is None:
            print("error: --_child-target needs --out", file=sys.stderr)
            return 2
        return child_main(args.child_target, args.dir, args.out)
    try:
        return repro(args)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def repro(args: argparse.Namespace) -> int:
    """Run the target, then the reference; print a line for each and the verdict (exit code)."""
    ref_spec, target_spec = parse_spec(args.ref), parse_spec(args.target)
    check_spec(ref_spec)
    check_spec(target_spec)
    crit = Criterion(args.metric, args.threshold, args.atol, args.rtol, args.precision)
    timeout = args.timeout if args.timeout and args.timeout > 0 else None
    directory: Path = args.dir
    bundle = load_bundle(directory)
    ref_runner = make_runner(ref_spec, timeout)
    target = _run_target(target_spec, bundle, directory, timeout)
    if isinstance(target, RunError) and target.crash and ref_spec.name not in ("exec", "dump"):
        # The reference may be the same runtime (+fp16 on ONNX Runtime), which the bundle
        # crashes as well: in a child of its own too, so that its crash is only its line.
        ref_runner = _in_child(ref_spec, directory, timeout)
    expected, ref_disagrees = _check_reference(ref_spec, ref_runner, bundle, crit)
    print(f"target     {target_spec.text}")
    if isinstance(target, RunError):
        return _report_run_error(target)
    return _verdict(expected, target, crit, ref_spec, ref_disagrees)


def _in_child(spec: Spec, directory: Path, timeout: float | None) -> Runner:
    """A runner of ``spec`` on this bundle in a fresh process (``run_target_in_child``)."""

    def run(_path: Path, _model: onnx.ModelProto, _inputs: Tensors) -> Tensors:
        return run_target_in_child(spec, directory, timeout)

    return run


def _run_target(
    spec: Spec, bundle: Bundle, directory: Path, timeout: float | None
) -> Tensors | RunError:
    """The target's outputs, or the error that stands for them in the verdict."""
    try:
        if spec.name in ("exec", "dump"):
            # A process of its own already, or only files read: neither can take this down.
            runner = make_runner(spec, timeout)
            return runner(bundle.model_path, bundle.model, bundle.inputs)
        return run_target_in_child(spec, directory, timeout)
    except RunError as exc:
        return exc


def _check_reference(
    spec: Spec, runner: Runner, bundle: Bundle, crit: Criterion
) -> tuple[Tensors, bool]:
    """Print the reference's line. Returns what the target is compared with (the recorded
    outputs, else this run's), and whether the reference disagrees with the recorded ones."""
    expected = bundle.expected
    try:
        ref_out = runner(bundle.model_path, bundle.model, bundle.inputs)
    except UsageError:
        raise
    except Exception as exc:
        print(f"reference  {spec.text}: could not run ({_one_line(exc)})")
        return expected, False
    if expected:
        rows = compare_all(expected, ref_out, crit)
        print(f"reference  {spec.text}: {_summary(rows, crit)}")
        return expected, any(r.diverged for r in rows)
    outputs = [o.name for o in bundle.model.graph.output]
    print(
        f"reference  {spec.text}: ran; the bundle records no expected outputs, "
        "so the target is compared with this run"
    )
    return {n: ref_out[n] for n in outputs if n in ref_out}, False


def _report_run_error(error: RunError) -> int:
    what = "crashed" if error.crash else "failed"
    print(f"  {what}: {error}")
    if error.stderr:
        print(f"  stderr: {error.stderr}")
    if not error.crash and SYMPTOM != "error":
        # An error the runtime reported is not the symptom this bundle was written for.
        print(f"COULD NOT RUN: the target {what}: {error}")
        return 2
    print(f"REPRODUCED: the target {what}: {error}")
    return 1


def _verdict(
    expected: Tensors, target: Tensors, crit: Criterion, ref_spec: Spec, ref_disagrees: bool
) -> int:
    if not expected:
        print(
            "NOT REPRODUCED: the target ran, and there is nothing to compare it with "
            "(no output_N.pb in the bundle, and the reference did not run)"
        )
        return 0
    rows = compare_all(expected, target, crit)
    width = max(len(r.name) for r in rows)
    for row in rows:
        print(_row_line(row, width, crit))
    diverged = [r.name for r in rows if r.diverged]
    if diverged and ref_disagrees:
        print(
            "REPRODUCED: the target diverges from the recorded reference outputs on this "
            f"subgraph ({', '.join(diverged)}); but the reference {ref_spec.text} also disagrees "
            "with the expected outputs here, so they may not hold on this machine"
        )
        return 1
    if diverged:
        # Each with its own reason: a flush or a NaN is not "rel_l2 > threshold".
        why = {r.reason for r in rows if r.diverged}
        said = (
            f"{', '.join(diverged)}: {why.pop()}"
            if len(why) == 1
            else "; ".join(f"{r.name}: {r.reason}" for r in rows if r.diverged)
        )
        print(f"REPRODUCED: the target diverges from the reference on this subgraph ({said})")
        return 1
    note = ""
    if ref_disagrees:
        note = f"; note that the reference {ref_spec.text} disagrees with the expected outputs"
    print(
        f"NOT REPRODUCED: the target matches the expected outputs on this subgraph "
        f"(every output agrees: {crit.agreement()}){note}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
