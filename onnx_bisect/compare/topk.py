"""Task-level check: do the two runs pick the same top-k labels?

Numbers can differ past a threshold while every label agrees (fp16 on a classifier), or stay
close while labels flip (the onnxoptimizer seed: top-1 labels changed on 3.4% of SSD images).
``--topk 5:logits`` compares, for every row of ``logits``, the top-5 labels along the last
axis; ``--topk 1:output0@1[4:]`` takes a YOLO head's class scores (axis 1, rows 4 onwards)
and asks whether each anchor keeps its label. Pure functions of arrays.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from onnx_bisect.errors import InputError
from onnx_bisect.text import plural

__all__ = ["ChangedRow", "TopKCheck", "TopKSpec", "parse_topk", "topk_check", "topk_checks"]


_GRAMMAR = re.compile(
    r"^(?P<k>\d+)(?::(?P<output>[^@\[]+))?(?:@(?P<axis>-?\d+))?"
    r"(?:\[(?P<start>-?\d*):(?P<stop>-?\d*)\])?$"
)


_SHOWN = 5  # changed rows listed in the report


@dataclass(frozen=True)
class TopKSpec:
    """``K[:OUTPUT][@AXIS][[START:STOP]]``; no output means every float output."""

    k: int
    output: str | None = None
    axis: int = -1
    start: int | None = None
    stop: int | None = None

    @property
    def text(self) -> str:
        out = f"{self.k}" + (f":{self.output}" if self.output else "") + f"@{self.axis}"
        if self.start is not None or self.stop is not None:
            out += f"[{'' if self.start is None else self.start}:"
            out += f"{'' if self.stop is None else self.stop}]"
        return out


@dataclass(frozen=True)
class ChangedRow:
    row: tuple[int, ...]  # index over the other axes
    ref_label: int
    target_label: int
    ref_score: float
    target_score: float


@dataclass(frozen=True)
class TopKCheck:
    output: str
    spec: str
    k: int
    rows: int
    top1_agreement: float  # fraction of rows whose best label is the same
    topk_overlap: float  # mean |ref top-k ∩ target top-k| / k
    rows_changed: int  # rows whose top-k set differs
    changed: tuple[ChangedRow, ...] = ()  # the first rows whose top-1 label changed
    # The highest reference top-1 score among rows whose label flipped: flips only among
    # near-zero scores (a detector's background anchors) are rounding, not lost detections.
    strongest_flip: float | None = None

    @property
    def agrees(self) -> bool:
        return self.rows_changed == 0

    def summary(self) -> str:
        flips = (
            f" (strongest flipped row's reference score: {self.strongest_flip:.4g})"
            if self.strongest_flip is not None
            else ""
        )
        return (
            f"{self.output} top-{self.k} ({self.spec}): top-1 labels agree on "
            f"{self.top1_agreement:.2%} of {plural(self.rows, 'row')}, top-{self.k} sets overlap "
            f"{self.topk_overlap:.2%}, {plural(self.rows_changed, 'row')} with a different "
            f"top-{self.k}{flips}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "output": self.output,
            "spec": self.spec,
            "k": self.k,
            "rows": self.rows,
            "top1_agreement": self.top1_agreement,
            "topk_overlap": self.topk_overlap,
            "rows_changed": self.rows_changed,
            "strongest_flip": self.strongest_flip,
            "changed": [
                {
                    "row": list(c.row),
                    "ref_label": c.ref_label,
                    "target_label": c.target_label,
                    "ref_score": c.ref_score,
                    "target_score": c.target_score,
                }
                for c in self.changed
            ],
        }


def parse_topk(text: str) -> TopKSpec:
    m = _GRAMMAR.match(text.strip())
    if not m or int(m["k"]) < 1:
        raise InputError(
            f"topk {text!r}: expected K[:OUTPUT][@AXIS][[START:STOP]], e.g. 5, 5:logits or "
            "1:output0@1[4:]",
            option="topk",
        )

    def bound(s: str | None) -> int | None:
        return int(s) if s else None

    return TopKSpec(
        k=int(m["k"]),
        output=m["output"].strip() if m["output"] else None,
        axis=int(m["axis"]) if m["axis"] else -1,
        start=bound(m["start"]),
        stop=bound(m["stop"]),
    )


def topk_checks(
    specs: list[TopKSpec],
    ref: Mapping[str, npt.NDArray[Any]],
    target: Mapping[str, npt.NDArray[Any]],
) -> tuple[TopKCheck, ...]:
    """One check per spec and output; a spec without an output covers every float output."""
    checks = []
    for spec in specs:
        if spec.output is not None and spec.output not in ref:
            known = ", ".join(sorted(ref)) or "none"
            raise InputError(
                f"topk {spec.text}: no output {spec.output!r}; outputs: {known}", option="topk"
            )
        names = [spec.output] if spec.output else [n for n in ref if _is_float(ref[n])]
        for name in names:
            if name in target:
                checks.append(topk_check(name, spec, ref[name], target[name]))
    return tuple(checks)


def topk_check(
    name: str, spec: TopKSpec, ref: npt.NDArray[Any], target: npt.NDArray[Any]
) -> TopKCheck:
    """Top-k label agreement along ``spec.axis`` for every position of the other axes."""
    if ref.shape != target.shape or ref.ndim == 0:
        raise InputError(
            f"topk {spec.text}: {name} has shape {ref.shape} vs {target.shape}", option="topk"
        )
    axis = spec.axis % ref.ndim
    sl = [slice(None)] * ref.ndim
    sl[axis] = slice(spec.start, spec.stop)
    a = np.moveaxis(np.asarray(ref, np.float64)[tuple(sl)], axis, -1)
    b = np.moveaxis(np.asarray(target, np.float64)[tuple(sl)], axis, -1)
    labels = a.shape[-1]
    if labels < spec.k:
        raise InputError(
            f"topk {spec.text}: {name} has only {labels} label(s) along axis {axis}",
            option="topk",
        )
    rows_shape = a.shape[:-1]
    a2, b2 = a.reshape(-1, labels), b.reshape(-1, labels)
    top_a, top_b = _top(a2, spec.k), _top(b2, spec.k)
    same_top1 = top_a[:, 0] == top_b[:, 0]
    overlap = np.array([len(set(x) & set(y)) for x, y in zip(top_a, top_b, strict=True)])
    flipped = np.flatnonzero(~same_top1)
    changed_rows = flipped[:_SHOWN]
    best_ref = a2[np.arange(len(a2)), top_a[:, 0]]
    offset = spec.start or 0
    changed = tuple(
        ChangedRow(
            row=tuple(int(i) for i in np.unravel_index(r, rows_shape)) if rows_shape else (),
            ref_label=int(top_a[r, 0]) + offset,
            target_label=int(top_b[r, 0]) + offset,
            ref_score=float(a2[r, top_a[r, 0]]),
            target_score=float(b2[r, top_b[r, 0]]),
        )
        for r in changed_rows
    )
    return TopKCheck(
        output=name,
        spec=spec.text,
        k=spec.k,
        rows=len(a2),
        top1_agreement=float(same_top1.mean()),
        topk_overlap=float(overlap.mean() / spec.k),
        rows_changed=int((overlap < spec.k).sum()),
        changed=changed,
        strongest_flip=float(best_ref[flipped].max()) if len(flipped) else None,
    )


def _top(x: npt.NDArray[np.float64], k: int) -> npt.NDArray[np.intp]:
    """Indices of the k largest per row, best first; ties broken by the lower index."""
    order = np.argsort(-x, axis=1, kind="stable")
    return order[:, :k]


def _is_float(a: npt.NDArray[Any]) -> bool:
    return bool(np.issubdtype(np.asarray(a).dtype, np.floating))
