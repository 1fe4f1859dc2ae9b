"""A quantized model's part of the result: how its tensors paired with the float model's, the
error each tensor's quantization adds, and the smallest set of nodes to keep in float; and
for a float16 conversion, the smallest set to keep in float32 (``KeepInFp32``)."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

from onnx_bisect.compare.quant import COARSE_LEVELS, QuantError, QuantKind
from onnx_bisect.text import fmt

__all__ = [
    "InputFigure",
    "IntegerSteps",
    "KeepInFloat",
    "KeepInFp32",
    "QuantReport",
    "QuantRow",
    "Sensitivity",
    "figure_lines",
]


@dataclass(frozen=True)
class InputFigure:
    """The goal's figure on one input (``--dataset``: each input, worst first): as the target
    runs the model (``before``) and with the set kept (``after``; None: no set to measure),
    and whether the goal holds there with the set."""

    input: str
    before: float
    after: float | None
    met: bool

    def to_dict(self) -> dict[str, Any]:
        after = None if self.after is None else _number(self.after)
        return {"input": self.input, "before": _number(self.before), "after": after,
                "met": self.met}  # fmt: skip

    def line(self) -> str:
        after = "" if self.after is None else f" -> {fmt(self.after)}"
        return f"{self.input}: {fmt(self.before)}{after}{'' if self.met else ' (missed)'}"


def _number(x: float) -> float | str:
    """JSON has no NaN or Infinity: spelt out, as report.json spells them everywhere."""
    return x if math.isfinite(x) else ("nan" if math.isnan(x) else "inf" if x > 0 else "-inf")


def figure_lines(figure: str, per_input: tuple[InputFigure, ...]) -> list[str]:
    """The per-input figures, a line each, under a heading naming the figure; nothing for
    one input (the answer's own line says it)."""
    if len(per_input) < 2:
        return []
    met = sum(f.met for f in per_input)
    head = f"{figure} per input, before -> with the set ({met} of {len(per_input)} meet the goal):"
    return [head, *(f"  {f.line()}" for f in per_input)]


@dataclass(frozen=True)
class QuantRow:
    """One quantized tensor: its scale, the error its round trip adds on the float model's
    values, and the tensors sharing its scale at a Concat/Add."""

    tensor: str  # the float model's name
    node: str  # the quantizing node in the quantized model
    scale: str  # QParams.describe()
    error: QuantError
    shared_with: tuple[str, ...] = ()
    shared_at: str = ""
    # Inputs of the merging node that span fewer than COARSE_LEVELS steps of this scale.
    lost: tuple[str, ...] = ()

    @property
    def kind(self) -> QuantKind:
        return QuantKind.SHARED if self.lost else self.error.kind

    @property
    def as_designed(self) -> bool:
        return self.kind is QuantKind.ROUNDING

    def to_dict(self) -> dict[str, Any]:
        return {
            "tensor": self.tensor,
            "node": self.node,
            "scale": self.scale,
            **self.error.to_dict(),
            "kind": self.kind.value,
            "shared_with": list(self.shared_with),
            "shared_at": self.shared_at or None,
            "range_lost": list(self.lost),
        }


@dataclass(frozen=True)
class Sensitivity:
    """The goal's number with only ``node`` kept in float (lower is better)."""

    node: str
    error: float


@dataclass(frozen=True)
class KeepInFloat:
    """The smallest set of nodes to keep in float that meets the goal: ``before``/``after``
    are the goal's number on the target and on the target patched as the quantizer would
    write it with the set excluded (``graph/unquantize.py``, ``graph/refloat.py``);
    ``requantized``, when the float model was quantized again (``--calibration``, or a
    dynamic model), the same two numbers on onnxruntime's own models, without and with the
    set excluded, which then decide ``verified``. ``call``: the quantizer call to paste."""

    nodes: tuple[str, ...]
    goal: str
    before: float
    after: float
    verified: bool
    runs: int
    model_path: str = ""
    note: str = ""
    requantized: tuple[float, float] | None = None
    call: str = ""
    settings: dict[str, Any] | None = None
    # The goal's figure on each input it is measured over (several with --dataset).
    per_input: tuple[InputFigure, ...] = ()
    figure: str = ""  # what per_input's numbers are
    # ``nodes_to_exclude``, or ``accuracy_level`` where the nodes' MatMulNBits computed with
    # float activations (their int4 weights kept) meet the goal: the kernel's int8
    # activations, not weight rounding, lose it; ``cause`` says which, ``float_activations``
    # the goal's number on that model.
    kind: str = "nodes_to_exclude"
    cause: str = ""
    float_activations: float | None = None
    # The goal's number with the nodes' weights quantized to 8 bits instead (re-quantized;
    # None: not tried); where it meets the goal the kind is ``customized_weight_config``,
    # ``call`` that config and ``alternative`` the nodes_to_exclude call.
    eight_bits: float | None = None
    alternative: str = ""

    @property
    def verified_by(self) -> str:
        """What ran the answer: ``requantized`` (onnxruntime's quantizer) or ``surgery``."""
        return "requantized" if self.requantized is not None else "surgery"

    @property
    def within(self) -> bool:
        """No small set recovers the loss: the model is within its quantization error."""
        return not self.nodes and self.note.startswith("within its quantization error")

    @property
    def nodes_to_exclude(self) -> str:
        return "nodes_to_exclude=[" + ", ".join(repr(n) for n in self.nodes) + "]"

    @property
    def builder_options(self) -> str:
        """A weight-only answer as onnxruntime-genai's model builder takes it (``--extra_options``
        ``int4_nodes_to_exclude``, comma-separated, with the settings read from the model);
        "" for other quantizers. The builder names its nodes as the torch exporter does
        (``/model/layers.0/mlp/up_proj/MatMul``), so a builder-made model's set pastes as is."""
        s = self.settings or {}
        if s.get("format") != "nbits" or not self.nodes:
            return ""
        opts = [f"int4_block_size={s['block_size']}",
                f"int4_is_symmetric={str(s['is_symmetric']).lower()}"]  # fmt: skip
        if self.kind == "accuracy_level":
            # The builder's own default is 4 on CPU and WebGPU: say fp32 (1) outright.
            opts.append("int4_accuracy_level=1")
        elif s.get("accuracy_level") is not None:
            opts.append(f"int4_accuracy_level={s['accuracy_level']}")
        if list(s.get("op_types_to_quantize", ["MatMul"])) != ["MatMul"]:
            opts.append(f"int4_op_types_to_quantize={'/'.join(s['op_types_to_quantize'])}")
        if s.get("quant_format") == "QDQ":
            opts.append("use_qdq=true")
        if self.kind != "accuracy_level":  # the builder sets no per-node bits: keep them
            opts.append(f"int4_nodes_to_exclude={','.join(self.nodes)}")
        return "--extra_options " + " ".join(opts)

    def to_dict(self) -> dict[str, Any]:
        requantized = None
        if self.requantized is not None:
            requantized = {"before": self.requantized[0], "after": self.requantized[1]}
        return {
            "nodes": list(self.nodes),
            "kind": self.kind,
            "cause": self.cause or None,
            "float_activations": self.float_activations,
            "eight_bits": self.eight_bits,
            "nodes_to_exclude": list(self.nodes),
            "goal": self.goal,
            "before": self.before,
            "after": self.after,
            "verified": self.verified,
            "verified_by": self.verified_by,
            "surgery": {"before": self.before, "after": self.after},
            "requantized": requantized,
            "call": self.call or None,
            "calls": self._calls(),
            "settings": self.settings,
            "runs": self.runs,
            "model": self.model_path or None,
            "note": self.note or None,
            "figure": self.figure or None,
            "per_input": [f.to_dict() for f in self.per_input],
        }

    def _calls(self) -> dict[str, str] | None:
        """Each tool's way to apply the answer: ``onnxruntime`` (the quantizer call) and, for
        a weight-only model, ``genai_builder`` (its ``--extra_options``)."""
        if not self.call:
            return None
        out = {"onnxruntime": self.call}
        if self.alternative:
            out["onnxruntime_nodes_to_exclude"] = self.alternative
        if self.builder_options:
            out["genai_builder"] = self.builder_options
        return out

    def lines(self) -> list[str]:
        """The answer, what verified it, and the call to paste."""
        out: list[str] = []
        if self.nodes:
            state = "verified" if self.verified else "NOT verified"
            by = "by re-quantizing" if self.requantized is not None else "on the patched model"
            measured = f"{fmt(self.before)} -> {fmt(self.after)}"
            if self.requantized is not None:
                b, a = self.requantized
                measured = f"{fmt(b)} -> {fmt(a)} re-quantized ({measured} patched)"
            if self.kind == "accuracy_level":
                out.append(
                    f"not weight rounding: {self.cause} ({state} {by}: {self.goal}: {measured})"
                )
            else:
                out.append(
                    f"keep in float ({state} {by}, {self.runs} runs): {self.nodes_to_exclude}; "
                    f"{self.goal}: {measured}"
                )
                if self.cause:
                    out.append(self.cause)
                if self.eight_bits is not None:
                    enough = self.kind == "customized_weight_config"
                    out.append(
                        f"8 bits are {'enough' if enough else 'not enough'} for them: "
                        f"{self.goal.split(' ≤')[0]} {fmt(self.eight_bits)} re-quantized with "
                        "their weights at 8 bits"
                    )
            if self.call:
                out.append(f"paste: {self.call}")
            if self.builder_options:
                out.append(f"onnxruntime-genai builder: {self.builder_options}")
        out += figure_lines(self.figure, self.per_input)
        if self.note:
            out.append(self.note)
        return out


@dataclass(frozen=True)
class IntegerSteps:
    """One quantized model on two backends: how its integers were compared. ``stepped``: the
    integer tensors compared in steps of their scales (``runtime`` of them read from the
    reference's run); ``bounded``: accumulators and their float results held to what their
    integer inputs one step apart make; ``apart``: the tensors found that far apart and no
    more (within the int8 precision), each with what was measured."""

    stepped: int
    runtime: int
    bounded: int
    apart: tuple[tuple[str, str], ...] = ()

    def line(self) -> str:
        said = (
            f"one model on two backends: {self.stepped} integer tensors compared in steps of "
            f"their scales ({self.runtime} read from the reference's run), {self.bounded} "
            "accumulators and float results held to what one-step input flips make"
        )
        if self.apart:
            names = ", ".join(t for t, _ in self.apart[:5])
            said += f"; within that precision, not a divergence: {names}"
        return said

    def to_dict(self) -> dict[str, Any]:
        return {
            "stepped": self.stepped,
            "runtime_scales": self.runtime,
            "bounded": self.bounded,
            "apart": [{"tensor": t, "reason": r} for t, r in self.apart],
        }


@dataclass(frozen=True)
class QuantReport:
    """Pairing counts by rule, the unpaired tensors with their reasons, the per-tensor table
    (worst first), the keep-in-float answer and the per-node sensitivity (most first)."""

    rules: dict[str, int]
    unpaired: dict[str, str]
    rows: tuple[QuantRow, ...]
    keep: KeepInFloat | None = None
    sensitivity: tuple[Sensitivity, ...] = ()
    # One model on two backends (no float model to pair with): how its integers compared.
    steps: IntegerSteps | None = None

    @property
    def flagged(self) -> tuple[QuantRow, ...]:
        return tuple(r for r in self.rows if not r.as_designed)

    def pairing_summary(self) -> str:
        rules = ", ".join(f"{n} by {rule}" for rule, n in sorted(self.rules.items()))
        total = sum(self.rules.values())
        return (
            f"quantized tensors paired with the float model: {total} ({rules or 'none'}); "
            f"unpaired: {len(self.unpaired)}"
        )

    def lines(self) -> list[str]:
        """What the terminal and report.md say first: the answer, then what stands out."""
        out: list[str] = [self.steps.line()] if self.steps is not None else []
        if self.keep is not None:
            out += self.keep.lines()
        kinds = Counter(r.kind.value for r in self.rows)
        if self.rows:
            out.append(
                "quantized tensors: "
                + ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items()))
            )
        for r in self.flagged[:5]:
            shared = (
                f", scale shared with {', '.join(r.shared_with)} at {r.shared_at}"
                if r.shared_with
                else ""
            )
            if r.lost:
                shared += f"; {', '.join(r.lost)} span < {COARSE_LEVELS:g} steps of it"
            out.append(
                f"  {r.tensor}: {r.kind.value} ({r.scale}, {r.error.levels:.1f} steps, "
                f"clipped {r.error.clipped:.1%}, SQNR {r.error.sqnr_db:.1f} dB{shared})"
            )
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "paired_by_rule": dict(self.rules),
            "unpaired": [{"tensor": t, "reason": r} for t, r in self.unpaired.items()],
            "tensors": [r.to_dict() for r in self.rows],
            "keep_in_float": self.keep.to_dict() if self.keep is not None else None,
            "sensitivity": [{"node": s.node, "error": s.error} for s in self.sensitivity],
            "integer_steps": self.steps.to_dict() if self.steps is not None else None,
        }


@dataclass(frozen=True)
class KeepInFp32:
    """The smallest block list that brings a float16 conversion's outputs within what float16
    predicts (or ``--quant-goal``): ``nodes`` (kind ``node_block_list``) or ``ops`` (kind
    ``op_block_list``, one op type at fault everywhere), verified by converting the float
    model again with onnxconverter-common and running it on the target; ``call`` is that
    conversion, to paste (with what the conversion keeps in float32 anyway). ``before`` and
    ``after``: the worst output's rel_l2 as converted and with the set kept."""

    nodes: tuple[str, ...]
    kind: str  # "node_block_list" or "op_block_list"
    ops: tuple[str, ...]
    call: str
    goal: str
    before: float
    after: float
    verified: bool
    verified_by: str
    runs: int
    note: str = ""
    # A line to run before ``call`` where the set names nodes unnamed in the file: it gives
    # them the names onnx-bisect gave them.
    prepare: str = ""
    # What ``before``/``after`` measure (the worst input's, where there are several), and
    # the goal's figure on each input it is measured over (several with --dataset).
    figure: str = "worst output rel_l2"
    per_input: tuple[InputFigure, ...] = ()
    # Where the torch backend computes float16 (dtype=float16): the modules the set's nodes
    # come from (graph/source.py), to keep in float32 under autocast.
    modules: tuple[str, ...] = ()

    def line(self) -> str:
        """The answer in one line, as the terminal says it."""
        if not self.nodes and not self.ops:
            return f"no set found: {self.note}"
        state = f"verified by {self.verified_by}" if self.verified else "NOT verified"
        named = self.ops if self.kind == "op_block_list" else self.nodes
        note = f"; {self.note}" if self.note else ""
        worst = "worst input's " if len(self.per_input) > 1 else ""
        return (
            f"{self.kind}={list(named)!r}: {self.goal}, {worst}{self.figure} {fmt(self.before)} "
            f"-> {fmt(self.after)} ({state}; {self.runs} runs){note}"
        )

    def lines(self) -> list[str]:
        """What follows ``line()``: the modules to keep in float32, the per-input figures."""
        out = [f"modules to keep in float32: {', '.join(self.modules)}"] if self.modules else []
        return out + figure_lines(self.figure, self.per_input)

    def to_dict(self) -> dict[str, Any]:
        return {
            "nodes": list(self.nodes),
            "ops": list(self.ops),
            "kind": self.kind,
            "call": self.call,
            "goal": self.goal,
            "before": self.before,
            "after": self.after,
            "verified": self.verified,
            "verified_by": self.verified_by,
            "runs": self.runs,
            "note": self.note or None,
            "prepare": self.prepare or None,
            "figure": self.figure,
            "per_input": [f.to_dict() for f in self.per_input],
            "modules": list(self.modules),
        }
