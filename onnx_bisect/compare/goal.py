"""The keep searches' goal (``--quant-goal``): what the outputs of a model with the set kept in
float (float32) must reach, on every input the goal is measured over (the one input, or
every input of ``--dataset``).

    X                          the worst output's rel_l2 <= X (a quantized model: the worst
                               output channel's)
    top1[:OUTPUT][@last]>=P    top-1 agreement >= P (0.99 or 99%) on every input: the
                               reference's and the target's best label along the last axis
                               are the same, at every position (@last: the last position
                               only, axis -2, an LLM's next token)
    rel_l2[:OUTPUT][@last]<=X  the output's rel_l2 <= X on every input (@last: the last
                               position's logits only)

Without OUTPUT every float output counts, the worst of them. Pure functions of arrays.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from onnx_bisect.compare.metrics import rel_l2
from onnx_bisect.compare.topk import TopKSpec, topk_check
from onnx_bisect.errors import InputError

__all__ = ["GOAL_FORMS", "QuantGoal", "parse_goal"]

GOAL_FORMS = "X, top1[:OUTPUT][@last]>=P or rel_l2[:OUTPUT][@last]<=X"

_GRAMMAR = re.compile(
    r"^(?P<metric>top1|rel_l2)(?::(?P<output>[^@<>=≤≥]+?))?(?P<last>@last)?\s*"
    r"(?P<op>>=|<=|≥|≤)\s*(?P<value>[0-9.eE+-]+)(?P<percent>%)?$"
)
_OPERATOR = {"top1": (">=", "≥"), "rel_l2": ("<=", "≤")}

Tensors = Mapping[str, npt.NDArray[Any]]


@dataclass(frozen=True)
class QuantGoal:
    """``metric``: ``error`` (a bare number: the searches' own error, as before task goals),
    ``top1`` or ``rel_l2``; ``bound``: the agreement to reach (top1) or the error not to
    exceed; ``output``: one output, or None for every float output; ``last``: the last
    position only."""

    metric: str
    bound: float
    output: str | None = None
    last: bool = False

    @property
    def task(self) -> bool:
        """A goal on named figures (top1, rel_l2), measured alike by every search."""
        return self.metric != "error"

    @property
    def text(self) -> str:
        """The goal as typed, in its canonical spelling."""
        if not self.task:
            return f"{self.bound:g}"
        where = (f":{self.output}" if self.output else "") + ("@last" if self.last else "")
        if self.metric == "top1":
            return f"top1{where}>={self.bound:.4g}"
        return f"rel_l2{where}<={self.bound:g}"

    @property
    def figure_name(self) -> str:
        """The per-input figure, in words: ``top-1 agreement of logits at the last position``."""
        name = "top-1 agreement" if self.metric == "top1" else "rel_l2"
        of = f" of {self.output}" if self.output else " (worst output)"
        return name + of + (" at the last position" if self.last else "")

    def describe(self, inputs: int) -> str:
        """The goal in words, over ``inputs`` inputs."""
        on = "on the input" if inputs == 1 else f"on every one of {inputs} inputs"
        if self.metric == "top1":
            return f"{self.figure_name} >= {self.bound:.2%} {on} (--quant-goal)"
        return f"{self.figure_name} <= {self.bound:g} {on} (--quant-goal)"

    @property
    def limit(self) -> float:
        """The bound on ``loss``: what the searches minimise (lower is better)."""
        return 1.0 - self.bound if self.metric == "top1" else self.bound

    def loss(self, figure: float) -> float:
        """A figure as a number to minimise: 1 − agreement for top1, the error otherwise."""
        return 1.0 - figure if self.metric == "top1" else figure

    def met(self, figure: float) -> bool:
        return figure >= self.bound if self.metric == "top1" else figure <= self.bound

    def worst(self, figures: list[float]) -> float:
        """The worst input's figure (the lowest agreement, the highest error)."""
        if not figures:
            return math.nan
        return min(figures) if self.metric == "top1" else max(figures)

    def figure(self, ref: Tensors, out: Tensors) -> float:
        """This goal's figure on one input: the worst selected output's top-1 agreement or
        rel_l2 (NaN or an output missing: no agreement, an infinite error)."""
        names = [self.output] if self.output else [n for n in ref if _is_float(ref[n])]
        values = []
        for name in names:
            got = out.get(name)
            if name not in ref or got is None or np.shape(got) != np.shape(ref[name]):
                values.append(0.0 if self.metric == "top1" else math.inf)
                continue
            a, b = np.asarray(ref[name]), np.asarray(got)
            if self.last:
                a, b = _last(a, name), _last(b, name)
            if self.metric == "top1":
                spec = TopKSpec(k=1, output=name)
                values.append(topk_check(name, spec, a, b).top1_agreement)
            else:
                value = rel_l2(a, b)
                values.append(value if value == value else math.inf)
        return self.worst(values)


def parse_goal(goal: float | str | QuantGoal) -> QuantGoal:
    """``--quant-goal``'s value: a number, or a task goal (module docstring)."""
    if isinstance(goal, QuantGoal):
        return goal
    if not isinstance(goal, str):
        return _number(goal)
    text = goal.strip()
    try:
        return _number(float(text))
    except ValueError:
        pass
    m = _GRAMMAR.match(text)
    if m is None or m["op"] not in _OPERATOR[m["metric"]]:
        raise InputError(
            f"quant_goal {goal!r}: expected {GOAL_FORMS}, e.g. 0.01, 'top1>=100%' or "
            "'rel_l2:logits@last<=1e-2'",
            option="quant_goal",
        )
    try:
        value = float(m["value"]) / (100.0 if m["percent"] else 1.0)
    except ValueError:
        value = math.nan
    top1 = m["metric"] == "top1"
    if not (0.0 < value <= 1.0 if top1 else 0.0 < value < math.inf):
        want = "an agreement in (0, 1] (or (0%, 100%])" if top1 else "a positive error"
        raise InputError(f"quant_goal {goal!r}: {want}", option="quant_goal")
    output = m["output"].strip() if m["output"] else None
    return QuantGoal(m["metric"], value, output, bool(m["last"]))


def _number(value: float) -> QuantGoal:
    if isinstance(value, bool) or not (isinstance(value, int | float) and 0.0 < value < math.inf):
        raise InputError(
            f"quant_goal must be a positive number or {GOAL_FORMS}, got {value!r}",
            option="quant_goal",
        )
    return QuantGoal("error", float(value))


def _last(a: npt.NDArray[Any], name: str) -> npt.NDArray[Any]:
    """The last position: index -1 of axis -2 ([batch, seq, vocab] -> [batch, 1, vocab])."""
    if a.ndim < 2:
        raise InputError(
            f"quant_goal @last: {name} has shape {a.shape}; the last position needs a "
            "[..., position, label] output",
            option="quant_goal",
        )
    return a[..., -1:, :]


def _is_float(a: npt.NDArray[Any]) -> bool:
    return bool(np.issubdtype(np.asarray(a).dtype, np.floating))
