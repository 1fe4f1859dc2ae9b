"""Options of a diagnosis: one definition of every option, its default and its accepted values,
for the API and the CLI (whose defaults are read from ``BisectOptions()`` and whose errors are
these, with flags for names)."""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy.typing as npt
import onnx

from onnx_bisect.compare.criterion import NOISE_EPS, NOISE_K, Criterion
from onnx_bisect.compare.goal import QuantGoal, parse_goal
from onnx_bisect.compare.metrics import METRICS
from onnx_bisect.compare.precision import parse_precision
from onnx_bisect.compare.topk import TopKSpec, parse_topk
from onnx_bisect.errors import InputError
from onnx_bisect.inputs.values import check_fills

# A criterion's ``noise`` and ``truth`` (see ``Criterion``).
NoiseFn = Callable[[str, npt.NDArray[Any]], float | None]
TruthFn = Callable[[str], tuple[npt.NDArray[Any], float] | None]

__all__ = [
    "DEFAULT_MAX_MEMORY",
    "DEFAULT_SAMPLE",
    "PASS_MODES",
    "STRATEGIES",
    "BisectOptions",
    "ModelLike",
]

DEFAULT_MAX_MEMORY = 4 << 30
# Inputs of a dataset scanned and isolated, worst first: each costs a diagnosis's runs, and
# the worst few say whether the culprit holds; the screen covers every input anyway.
DEFAULT_SAMPLE = 8
STRATEGIES = ("auto", "scan", "bisect")
PASS_MODES = ("auto", "on", "off")
# --threshold auto: an error whose max_abs is at most this × the tensor's peak |reference| is
# not significant (8 fp32 ulps of the tensor's scale; a sigmoid tail off by 4e-7 near 1e-7).
SIGNIFICANCE = 1e-6
ModelLike = str | os.PathLike[str] | onnx.ModelProto

# What a fixed threshold can be, per metric; the others are distances, where below 0 every
# tensor would diverge. Cosine is a similarity in [-1, 1]; SQNR in dB takes any value.
_THRESHOLD_RANGES: Mapping[str, tuple[float, float, str]] = {
    "cosine": (-1.0, 1.0, "in [-1, 1]"),
    "sqnr_db": (-math.inf, math.inf, ""),
}
_DISTANCE = (0.0, math.inf, ">= 0")


@dataclass(frozen=True)
class BisectOptions:
    """How to diagnose; see ``onnx_bisect.bisect`` for what each option does. Every value is
    checked here, before anything loads or runs: an ``InputError`` names the option (its
    ``option``) and what it accepts."""

    inputs: Path | Mapping[str, npt.NDArray[Any]] | None = None
    shapes: Mapping[str, Sequence[int]] | None = None
    # Generated inputs only: input name -> every element this constant (ints kept exact) ...
    values: Mapping[str, float] | None = None
    # ... or -> (low, high): floats uniform in [low, high), integers in [low, high] inclusive.
    ranges: Mapping[str, tuple[float, float]] | None = None
    seed: int = 0
    # Inputs holding NaN or Inf (generated or given) are refused unless this is set: they
    # hide divergences (NaN is unequal to itself, an infinity swallows any error).
    allow_nonfinite: bool = False
    metric: str = "rel_l2"
    threshold: float | str = "auto"
    noise_k: float = NOISE_K
    noise_eps: float = NOISE_EPS
    atol: float | None = None
    rtol: float | None = None
    max_memory: int = DEFAULT_MAX_MEMORY
    parallel: bool = True
    always_scan: bool = False
    strategy: str = "auto"
    isolate_crashes: bool | None = None
    timeout: float | None = None
    repro: str | os.PathLike[str] | None = None
    target_model: ModelLike | None = None
    # What the target computes float32 work in, when nothing else says (an exec: runtime):
    # float16, bfloat16, tf32 or float32. Its precision floors then judge it.
    target_precision: str | None = None
    topk: Sequence[str | TopKSpec] = ()
    # The keep searches' goal (compare/goal.py): a number, the worst output (channel)'s
    # rel_l2 (1 − top-1 agreement with ``topk``), or a task goal measured on every input
    # (``top1:logits@last>=100%``, ``rel_l2:logits@last<=1e-2``); None: recover most of the
    # loss quantization causes with a few nodes (engine/quant/keep.py), or float16's
    # predicted error (engine/keep16.py).
    quant_goal: float | str | QuantGoal | None = None
    # A quantized target model's calibration inputs (a directory, a glob or one .npz split
    # in rows, as ``dataset`` reads them): the float model is quantized again with them and
    # the int8 model's settings to verify the keep-in-float set (engine/quant/verify.py).
    calibration: str | os.PathLike[str] | None = None
    unroll_max: int = 64
    # After a divergence: which optimizer passes of the target cause it (auto: divergences
    # only; on: failures too; off: never), and the pass names of an exec: runtime.
    bisect_passes: str = "auto"
    passes: Sequence[str] = ()
    command: str = ""
    # Dataset mode: many inputs (a directory, a glob, or one .npz split along its leading
    # axis), each screened; the worst ``sample`` scanned and isolated (None: DEFAULT_SAMPLE),
    # in ``jobs`` local processes or as Ray tasks (``ray``: an address, or "local").
    dataset: str | os.PathLike[str] | None = None
    sample: int | None = None
    jobs: int = 1
    ray: str | None = None
    # Multi-step mode: the model run ``steps`` times in lockstep on both sides, each step fed
    # the reference's outputs of the step before (``state`` rules ``OUT=IN``, else Hugging
    # Face names) and its chunk of ``chunks`` (an .npz split along axis 0); ``free_run`` also
    # lets each side feed itself.
    steps: int | None = None
    state: Sequence[str] = ()
    chunks: str | os.PathLike[str] | None = None
    free_run: bool = False

    def __post_init__(self) -> None:
        # What needs no model fails here, before anything loads; the rest in make_feeds.
        _check_shapes(self.shapes)
        check_fills(self.values, self.ranges)
        _whole("seed", self.seed, low=0)
        _choice("metric", self.metric, tuple(METRICS))
        _choice("strategy", self.strategy, STRATEGIES)
        self._check_threshold()
        _number("noise_k", self.noise_k)
        _number("noise_eps", self.noise_eps)
        _number("atol", self.atol, optional=True)
        _number("rtol", self.rtol, optional=True)
        _number("timeout", self.timeout, positive=True, optional=True)
        _whole("max_memory", self.max_memory, low=1, what="a whole number of bytes")
        _flag("allow_nonfinite", self.allow_nonfinite)
        _flag("parallel", self.parallel)
        _flag("always_scan", self.always_scan)
        _flag("isolate_crashes", self.isolate_crashes, optional=True)
        self.topk_specs()
        self.goal()
        self._check_calibration()
        _whole("unroll_max", self.unroll_max, low=0)
        _choice("bisect_passes", self.bisect_passes, PASS_MODES)
        if self.target_precision is not None:
            try:
                parse_precision(self.target_precision)
            except ValueError as exc:
                raise InputError(f"target_precision: {exc}", option="target_precision") from None
        self._check_dataset()
        self._check_steps()
        self._check_together()

    def _check_threshold(self) -> None:
        if isinstance(self.threshold, str):
            if not self._auto_requested:
                raise InputError(
                    f"threshold must be a number or 'auto', got {self.threshold!r}",
                    option="threshold",
                )
            return
        low, high, what = _THRESHOLD_RANGES.get(self.metric, _DISTANCE)
        if not _is_number(self.threshold) or not low <= self.threshold <= high:
            scope = "" if self.metric == "rel_l2" else f" for metric {self.metric}"
            bound = f" {what}" if what else ""
            auto = " or 'auto'" if METRICS[self.metric].higher_is_worse else ""
            raise InputError(
                f"threshold{scope} must be a finite number{bound}{auto}, got {self.threshold!r}",
                option="threshold",
            )

    def _check_together(self) -> None:
        """Options that say nothing in the company they are in: silently ignoring one would
        answer a question the user did not ask."""
        allclose = self.atol is not None or self.rtol is not None
        if allclose and not self._auto_requested:
            raise InputError(
                f"threshold {self.threshold!r} has no effect with atol/rtol, where allclose "
                "decides; give one or the other",
                option="threshold",
            )
        if allclose and self.metric != "rel_l2":
            raise InputError(
                f"metric {self.metric} has no effect with atol/rtol, where allclose decides; "
                "give one or the other",
                option="metric",
            )
        if self._auto_requested and not METRICS[self.metric].higher_is_worse:
            # "auto" is a fixed 1e-3 beside the other metrics: nothing, for a similarity.
            raise InputError(
                f"metric {self.metric} needs a threshold: 'auto' exists for rel_l2, max_abs "
                f"and mean_abs; give one, e.g. {_EXAMPLES[self.metric]}",
                option="metric",
            )
        noise = (("noise_k", self.noise_k, NOISE_K), ("noise_eps", self.noise_eps, NOISE_EPS))
        for name, value, default in noise:
            if value != default and not self.auto_threshold:
                raise InputError(
                    f"{name} applies to threshold 'auto' with metric rel_l2 only (a noise "
                    "floor), not to a fixed threshold or atol/rtol",
                    option=name,
                )

    def _check_calibration(self) -> None:
        if self.calibration is None:
            return
        if self.target_model is None:
            raise InputError(
                "calibration applies only to a quantized --target-model (its float model is "
                "quantized again on these inputs)",
                option="calibration",
            )
        if not isinstance(self.calibration, str | os.PathLike):
            raise InputError(
                f"calibration must be a path, got {self.calibration!r}", option="calibration"
            )
        from onnx_bisect.inputs.dataset import find_dataset

        try:
            find_dataset(self.calibration)  # names inputs, or says why not
        except InputError as exc:
            text = str(exc).removeprefix("dataset ")
            raise InputError(f"calibration {text}", option="calibration") from None

    def _check_dataset(self) -> None:
        """The dataset's options mean nothing without one; with one, the inputs are its own."""
        if self.sample is not None:
            _whole("sample", self.sample, low=1)
        _whole("jobs", self.jobs, low=1)
        if self.ray is not None and (not isinstance(self.ray, str) or not self.ray.strip()):
            raise InputError(
                f"ray must be a cluster address or 'local', got {self.ray!r}", option="ray"
            )
        if self.dataset is None:
            given = [
                (name, value)
                for name, value, default in (
                    ("sample", self.sample, None),
                    ("jobs", self.jobs, 1),
                    ("ray", self.ray, None),
                )
                if value != default
            ]
            if given:
                name, value = given[0]
                raise InputError(f"{name} {value!r} applies only with a dataset", option=name)
            return
        if self.inputs is not None:
            raise InputError(
                "dataset: the inputs are given as well; give a dataset for many inputs or the "
                "inputs of one, not both",
                option="dataset",
            )
        if not isinstance(self.dataset, str | os.PathLike):
            raise InputError(
                f"dataset must be a directory, a glob or a .npz path, got {self.dataset!r}",
                option="dataset",
            )
        fills = (("shapes", self.shapes), ("values", self.values), ("ranges", self.ranges))
        generated = [name for name, given in fills if given]
        if generated:
            raise InputError(
                f"dataset: {', '.join(generated)} apply to generated inputs only, and a "
                "dataset's inputs are given; leave them out",
                option="dataset",
            )

    def _check_steps(self) -> None:
        """The steps' options mean nothing without ``steps``; a dataset is another loop."""
        _flag("free_run", self.free_run)
        if self.steps is None:
            given = [
                (name, value)
                for name, value, default in (
                    ("state", tuple(self.state), ()),
                    ("chunks", self.chunks, None),
                    ("free_run", self.free_run, False),
                )
                if value != default
            ]
            if given:
                name, value = given[0]
                raise InputError(f"{name} {value!r} applies only with steps", option=name)
            return
        _whole("steps", self.steps, low=1)
        if isinstance(self.state, str) or not all(isinstance(r, str) for r in self.state):
            raise InputError(
                f"state must be a list of 'OUT=IN' rules, got {self.state!r}", option="state"
            )
        if self.dataset is not None:
            raise InputError(
                "steps: a dataset is a loop of its own; give steps or a dataset, not both",
                option="steps",
            )

    @property
    def auto_threshold(self) -> bool:
        """``threshold="auto"`` (the default): per-tensor noise floors measured against
        float64. They exist for rel_l2 only, so max_abs, mean_abs or atol/rtol keep the fixed
        1e-3 that "auto" stands for there."""
        return (
            self._auto_requested
            and self.metric == "rel_l2"
            and self.atol is None
            and self.rtol is None
        )

    @property
    def _auto_requested(self) -> bool:
        return isinstance(self.threshold, str) and self.threshold.strip().lower() == "auto"

    def criterion(self) -> Criterion:
        """The fixed part of the criterion (a noise floor is added once it is measured)."""
        fixed = 1e-3 if self._auto_requested else float(self.threshold)
        return Criterion(metric=self.metric, threshold=fixed, atol=self.atol, rtol=self.rtol)

    def noise_criterion(self, noise: NoiseFn, truth: TruthFn | None = None) -> Criterion:
        """``--threshold auto``'s criterion: rel_l2 above ``--noise-k`` × each tensor's noise
        floor (``noise``) + ``--noise-eps``."""
        return replace(
            self.criterion(),
            noise=noise,
            truth=truth,
            k=self.noise_k,
            eps=self.noise_eps,
            significance=SIGNIFICANCE,
        )

    def goal(self) -> QuantGoal | None:
        """``quant_goal`` parsed (a bare number as ``QuantGoal('error', X)``)."""
        return None if self.quant_goal is None else parse_goal(self.quant_goal)

    def topk_specs(self) -> tuple[TopKSpec, ...]:
        return tuple(parse_topk(t) if isinstance(t, str) else t for t in self.topk)


# A threshold to suggest for the metrics "auto" does not cover.
_EXAMPLES = {"cosine": "0.9999", "sqnr_db": "40 (dB)"}


def _is_number(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def _number(name: str, value: object, *, positive: bool = False, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not _is_number(value) or (value <= 0 if positive else value < 0):  # type: ignore[operator]
        bound = "> 0" if positive else ">= 0"
        alt = " or None" if optional else ""
        raise InputError(f"{name} must be a finite number {bound}{alt}, got {value!r}", option=name)


def _flag(name: str, value: object, *, optional: bool = False) -> None:
    if not isinstance(value, bool) and not (optional and value is None):
        alt = ", or None" if optional else ""
        raise InputError(f"{name} must be True or False{alt}, got {value!r}", option=name)


def _whole(name: str, value: object, *, low: int, what: str = "an integer") -> None:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < low:
        raise InputError(f"{name} must be {what} >= {low}, got {value!r}", option=name)


def _choice(name: str, value: object, choices: Sequence[str]) -> None:
    if value not in choices:
        raise InputError(f"{name}: {value!r} is not one of {', '.join(choices)}", option=name)


def _check_shapes(shapes: Mapping[str, Sequence[int]] | None) -> None:
    """Sizes of generated inputs: an empty input (a 0 dim) runs nothing worth comparing, and
    most runtimes reject or mishandle it; a -1 is a dynamic dim left unset."""
    if shapes is None:
        return
    if not isinstance(shapes, Mapping):
        raise InputError(f"shapes must map input names to dims, got {shapes!r}", option="shapes")
    for name, dims in shapes.items():
        if not isinstance(dims, Sequence) or not all(
            isinstance(d, numbers.Integral) and not isinstance(d, bool) and d >= 1 for d in dims
        ):
            raise InputError(
                f"shapes: {name!r} is {dims!r}; dims must be integers >= 1 (where the model "
                "says -1 or 0, give the size)",
                option="shapes",
            )
