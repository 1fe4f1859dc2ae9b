"""The torch spec: ``torch[:DEVICE][?dtype=..&compile=..&tf32=0|1&deterministic=0|1&threads=N
&round=float16|bfloat16|tf32&fallback=0|1]``.

``fallback=1`` computes a node the backend cannot (an operator it lacks, a use of one its
translation fails on) alone by ``onnx.reference``, else by ONNX Runtime (``stand_in.py``),
and says so in its notes: the float64 oracle's setting, so that one op costs one node's
float64 value, not the whole model's.

``round=`` makes a *faithful* lower-precision runtime: every node computes in float32 from
operands rounded to that precision and its outputs are rounded again (TF32: MatMul, Gemm and
Conv operands only), as a correct fp16/bf16/TF32 kernel that accumulates in float32 does. The
float64 oracle runs it to measure the error a precision predicts for each tensor.

Parsed without importing torch, so a bad spec is a one-line usage error even where torch is
not installed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from dataclasses import dataclass

import onnx

from onnx_bisect.backends.spec import BackendSpec
from onnx_bisect.errors import SpecError

__all__ = [
    "COMPILERS",
    "DTYPES",
    "FLOAT32_NODES",
    "KEYS",
    "ROUNDINGS",
    "TorchOptions",
    "float32_nodes",
    "with_float32_nodes",
]

# A model's metadata key: the nodes (a JSON list of names) a float16/bfloat16 dtype= run
# computes in float32 (the keep-in-fp32 search's trials, ``engine/keep16.py``).
FLOAT32_NODES = "onnx_bisect.float32_nodes"

DTYPES = ("float32", "float16", "bfloat16", "float64")
COMPILERS = ("inductor", "aot_eager", "eager")
KEYS = ("dtype", "compile", "tf32", "deterministic", "threads", "round", "fallback")
ROUNDINGS = ("float16", "bfloat16", "tf32")
_DEVICE = re.compile(r"^(cpu|mps|xpu(:\d+)?|cuda(:\d+)?)$")
_FLAGS = {"0": False, "1": True, "false": False, "true": True, "off": False, "on": True}


@dataclass(frozen=True)
class TorchOptions:
    device: str = "cpu"
    dtype: str | None = None  # None: every tensor in the model's own type
    compile: str | None = None
    tf32: bool = False  # off unless asked: strict float32 is what a reference means
    deterministic: bool | None = None  # None: leave torch's setting alone
    threads: int | None = None  # None: torch's own intra-op thread count
    round: str | None = None  # a faithful lower precision (module docstring); None: none
    fallback: bool = False  # nodes torch cannot compute computed alone another way

    @classmethod
    def parse(cls, spec: BackendSpec) -> TorchOptions:
        spec.check_options(KEYS)
        device = spec.device or "cpu"
        if not _DEVICE.match(device):
            raise SpecError(
                f"backend {spec.text!r}: unknown torch device {device!r}; "
                "use cpu, cuda, cuda:N, mps or xpu"
            )
        dtype = _choice(spec, "dtype", DTYPES)
        if dtype == "float64" and device == "mps":
            raise SpecError(f"backend {spec.text!r}: MPS has no float64; use dtype=float32")
        return cls(
            device=device,
            dtype=dtype,
            compile=_choice(spec, "compile", COMPILERS),
            tf32=bool(_flag(spec, "tf32")),
            deterministic=_flag(spec, "deterministic"),
            threads=_count(spec, "threads"),
            round=_rounding(spec, dtype),
            fallback=bool(_flag(spec, "fallback")),
        )

    def label(self) -> str:
        parts = [f"dtype={self.dtype}" if self.dtype else "dtype=as written"]
        if self.compile:
            parts.append(f"compile={self.compile}")
        if self.device.startswith("cuda"):
            parts.append(f"tf32={int(self.tf32)}")
        if self.deterministic is not None:
            parts.append(f"deterministic={int(self.deterministic)}")
        if self.threads is not None:
            parts.append(f"threads={self.threads}")
        if self.round is not None:
            parts.append(f"round={self.round}")
        if self.fallback:
            parts.append("fallback=1")
        return " ".join(parts)


def _choice(spec: BackendSpec, key: str, allowed: tuple[str, ...]) -> str | None:
    value = spec.option(key)
    if value is None:
        return None
    if value.lower() not in allowed:
        raise SpecError(f"backend {spec.text!r}: {key} must be one of {', '.join(allowed)}")
    return value.lower()


def _rounding(spec: BackendSpec, dtype: str | None) -> str | None:
    rounding = _choice(spec, "round", ROUNDINGS)
    if rounding is not None and dtype not in (None, "float32"):
        raise SpecError(
            f"backend {spec.text!r}: round= computes in float32 and rounds to its precision; "
            "leave dtype= out"
        )
    return rounding


def _count(spec: BackendSpec, key: str) -> int | None:
    value = spec.option(key)
    if value is None:
        return None
    if not value.isdigit() or int(value) < 1:
        raise SpecError(f"backend {spec.text!r}: {key} must be a whole number of at least 1")
    return int(value)


def _flag(spec: BackendSpec, key: str) -> bool | None:
    value = spec.option(key)
    if value is None:
        return None
    if value.lower() not in _FLAGS:
        raise SpecError(f"backend {spec.text!r}: {key} must be 0 or 1")
    return _FLAGS[value.lower()]


def float32_nodes(model: onnx.ModelProto) -> frozenset[str]:
    """The nodes ``model`` asks a float16/bfloat16 run to compute in float32."""
    for prop in model.metadata_props:
        if prop.key == FLOAT32_NODES:
            return frozenset(json.loads(prop.value))
    return frozenset()


def with_float32_nodes(model: onnx.ModelProto, nodes: Collection[str]) -> onnx.ModelProto:
    """A copy of ``model`` marked to compute ``nodes`` in float32 (external weights stay
    where they are)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    kept = [p for p in out.metadata_props if p.key != FLOAT32_NODES]
    del out.metadata_props[:]
    out.metadata_props.extend(kept)
    if nodes:
        out.metadata_props.add(key=FLOAT32_NODES, value=json.dumps(sorted(nodes)))
    return out
