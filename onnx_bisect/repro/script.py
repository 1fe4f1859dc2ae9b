"""Rendering a repro bundle's standalone ``repro.py`` from the template module beside this one.

A runtime maintainer gets a directory with ``model.onnx``, ``test_data_set_0/input_N.pb`` and
``output_N.pb``, and this script. It must run with numpy, onnx and their own runtime alone, so
it is one self-contained file: ``template.py`` restates what onnx-bisect knows about specs, the
exec: protocol and the metrics, and imports onnx-bisect only as a fallback for specs it cannot
run by itself (plugins, ``ref?dtype=float64``). It is a real module, so that ruff, mypy and the
tests see it; rendering reads its text and writes the recorded values over its placeholders.
"""

from __future__ import annotations

import math
import re
from functools import cache
from importlib import resources

__all__ = ["SCRIPT_METRICS", "SCRIPT_PRECISIONS", "SYMPTOMS", "render_repro_script"]


# The metrics the script can compute; tests check this against the template's ``metrics()``.
SCRIPT_METRICS = ("rel_l2", "max_abs", "mean_abs", "cosine", "sqnr_db")
# The lower precisions the script judges with their range test (template.FORMATS).
SCRIPT_PRECISIONS = ("float16", "bfloat16", "tf32")
# What a bundle reproduces: a wrong value, the target dying, or the target reporting an error.
SYMPTOMS = ("divergence", "crash", "error")


# Docstring lines and string literals are wrapped to stay within ruff's line length (100).
_DOC_WIDTH = 96
_LITERAL_WIDTH = 88


@cache
def _template() -> str:
    """The text of ``template.py``, read as package data so that it works from a wheel too."""
    return resources.files("onnx_bisect.repro").joinpath("template.py").read_text("utf-8")


def render_repro_script(
    *,
    ref: str,
    target: str,
    metric: str = "rel_l2",
    threshold: float = 1e-3,
    atol: float | None = None,
    rtol: float | None = None,
    title: str = "",
    workdir: str | None = None,
    symptom: str = "divergence",
    precision: str | None = None,
) -> str:
    """The text of a bundle's ``repro.py``, comparing ``target`` with ``ref`` as recorded.

    ``metric`` and ``threshold`` (or ``atol``/``rtol``, which take precedence, as allclose)
    are the criterion the diagnosis used; a threshold of "auto" must be resolved to a number
    by the caller. ``symptom`` is what reproduces (exit 1): "divergence", "crash" or "error"
    (the target reporting an error, e.g. a missing kernel). ``precision``: the lower precision
    the target was declared to compute in, judged with its range test. ``title`` goes into the
    script's docstring. ``workdir`` is where exec: commands run (where onnx-bisect ran, so that
    their relative paths still resolve).
    """
    if precision not in (None, *SCRIPT_PRECISIONS):
        raise ValueError(f"render_repro_script: precision must be one of {SCRIPT_PRECISIONS}")
    if symptom not in SYMPTOMS:
        raise ValueError(f"render_repro_script: symptom must be one of {', '.join(SYMPTOMS)}")
    for role, spec in (("ref", ref), ("target", target)):
        if not spec.strip():
            raise ValueError(f"render_repro_script: {role} spec is empty; pass e.g. 'cpu'")
    if metric not in SCRIPT_METRICS:
        raise ValueError(
            f"render_repro_script: unknown metric {metric!r}; choose from "
            f"{', '.join(SCRIPT_METRICS)}"
        )
    values = {"threshold": threshold, "atol": atol, "rtol": rtol}
    for name, value in values.items():
        if value is not None and (isinstance(value, bool) or not math.isfinite(value)):
            raise ValueError(
                f"render_repro_script: {name}={value!r} must be a finite number; resolve "
                "an automatic threshold to a number first"
            )
    # Each placeholder occurs once in the template (a test checks): a line of its docstring, and
    # the quoted strings that stand in for the recorded values. Those of other types than str
    # only feed argparse defaults, so the unfilled template type-checks as it is.
    replacements = {
        "__TITLE__\n": _title_block(title),
        '"__REF__"': _literal(ref.strip()),
        '"__TARGET__"': _literal(target.strip()),
        '"__METRIC__"': _quoted(metric),
        '"__THRESHOLD__"': repr(float(threshold)),
        '"__ATOL__"': "None" if atol is None else repr(float(atol)),
        '"__RTOL__"': "None" if rtol is None else repr(float(rtol)),
        '"__WORKDIR__"': "None" if workdir is None else _literal(workdir),
        '"__SYMPTOM__"': _quoted(symptom),
        '"__PRECISION__"': "None" if precision is None else _quoted(precision),
    }
    # One pass: a title or spec that contains a placeholder is never substituted again.
    pattern = re.compile("|".join(re.escape(k) for k in replacements))
    return pattern.sub(lambda m: replacements[m[0]], _template())


def _literal(value: str) -> str:
    """A string literal for ``value``, split into implicitly concatenated pieces when long."""
    text = _quoted(value)
    if len(text) <= _LITERAL_WIDTH:
        return text
    pieces: list[str] = []
    current = ""
    for ch in value:
        if current and len(_quoted(current + ch)) > _LITERAL_WIDTH:
            pieces.append(current)
            current = ""
        current += ch
    pieces.append(current)
    return "(\n" + "".join(f"    {_quoted(p)}\n" for p in pieces) + ")"


def _quoted(value: str) -> str:
    """``repr(value)``, in double quotes where that needs no escapes (as ruff format writes)."""
    text = repr(value)
    if text.startswith("'") and '"' not in value:
        # In a single-quoted repr every ' is escaped as \', so this undoes exactly those.
        return '"' + text[1:-1].replace("\\'", "'") + '"'
    return text


def _title_block(title: str) -> str:
    """The title as docstring lines: printable, escaped, wrapped; empty for no title."""
    words = "".join(c if c.isprintable() else " " for c in title).split()
    if not words:
        return ""
    lines: list[str] = []
    line = ""
    for word in words:
        # Escape per character, so that a wrap never separates a backslash from what it escapes.
        chars = [c.replace("\\", "\\\\").replace('"', '\\"') for c in word]
        escaped = "".join(chars)
        if line and len(line) + 1 + len(escaped) <= _DOC_WIDTH:
            line += " " + escaped
            continue
        if line:
            lines.append(line)
        line = ""
        for c in chars:
            if len(line) + len(c) > _DOC_WIDTH:
                lines.append(line)
                line = ""
            line += c
    lines.append(line)
    return "\n".join(lines) + "\n\n"
