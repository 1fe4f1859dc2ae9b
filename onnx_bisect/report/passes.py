"""The pass bisection, as the reports show it: what broke, and the workaround in each form.

A workaround that keeps a long pass list (a transform's default list less the guilty pass is
~1,000 characters) is not put in a table cell: each form gets a code block, wrapped so that it
still runs when pasted (the spec as shell words continued across lines, Python inside its
brackets).
"""

from __future__ import annotations

import re
import textwrap

from onnx_bisect.result import PassBisection, PassOutcome, PassScope, target_arg
from onnx_bisect.text import plural

__all__ = ["pass_markdown", "shell_lines", "workaround_step"]

_MAX_LISTED = 12  # passes or node names listed; the rest are counted
_VERIFIED = "verified: it agrees with the reference"
WIDTH = 88  # of a wrapped code line
_CELL = 120  # the longest form a table cell holds; longer ones get code blocks


def pass_markdown(pb: PassBisection) -> list[str]:
    """The "Optimizer pass" section of report.md."""
    out = ["", "**Optimizer pass**", ""]
    if pb.outcome is not PassOutcome.GUILTY:
        return [*out, pb.reason + ".", ""]
    out.append(
        f"`{'` + `'.join(pb.guilty)}` makes the target diverge ({_runs(pb)}; "
        f"{plural(len(pb.passes), 'pass', 'passes')} rewrite {_what(pb)}: "
        f"{_listed(pb.passes, code=True)})."
    )
    if pb.parts_of:
        rules = ", ".join(f"`{p}`" for p in pb.parts) or "none"
        out.append(f"`{pb.parts_of}` is made of rules; those that change it: {rules}.")
    if pb.scope_note:
        out.append(f"Searched on the whole model: {pb.scope_note}.")
    if pb.rewritten:
        out.append(f"It rewrote {_listed(pb.rewritten, code=True)}.")
    if pb.details:  # torch's compiler bisector: backend, subsystem, application, debug info
        out += ["", "| torch.compile | found |", "|---|---|"]
        out += [f"| {what} | `{value}` |" for what, value in pb.details]
    state = _VERIFIED if pb.workaround_verified else "not verified"
    return [*out, "", f"Workaround ({state}):", "", *_workaround(pb), ""]


def _workaround(pb: PassBisection) -> list[str]:
    forms = [("onnx-bisect", target_arg(pb.workaround)), *pb.workaround_forms]
    if all(len(text) <= _CELL for _, text in forms):
        return ["| where | how |", "|---|---|", *(f"| {w} | `{t}` |" for w, t in forms)]
    out = [f"`{'`, `'.join(pb.guilty)}` off, everything else as it was:"]
    for where, text in forms:
        if where == "onnx-bisect":
            lines, lang = shell_lines(pb.workaround), "sh"
        elif where.startswith("Python"):
            lines, lang = _python_lines(text), "python"
        else:
            lines, lang = [text], ""
        out += ["", f"{where}:", "", f"```{lang}", *lines, "```"]
    return out


def shell_lines(spec: str) -> list[str]:
    """``--target 'SPEC'`` over lines of at most ``WIDTH`` characters, broken after commas: each
    line closes its quote and continues (``'…,'\\``), so the shell joins them into one word."""
    if "'" in spec or len(spec) + 11 <= WIDTH:
        return [target_arg(spec)]
    lines, line = [], "--target '"
    for piece in re.split(r"(?<=,)", spec):
        if len(line) + len(piece) + 2 > WIDTH and line not in ("--target '", "'"):
            lines.append(line + "'\\")
            line = "'"
        line += piece
    return [*lines, line + "'"]


def _python_lines(text: str) -> list[str]:
    # Python joins the lines of an expression inside brackets, and the forms break only there.
    return textwrap.wrap(
        text, WIDTH, subsequent_indent="    ", break_long_words=False, break_on_hyphens=False
    )


def workaround_step(pb: PassBisection) -> str:
    """The "Next steps" item for the workaround."""
    state = "verified" if pb.workaround_verified else "not verified"
    arg = target_arg(pb.workaround)
    where = f"`{arg}`" if len(arg) <= WIDTH else "as **Optimizer pass** above gives it"
    return f"Work around it ({state}): {where}."


def _what(pb: PassBisection) -> str:
    if pb.scope is PassScope.SUBGRAPH:
        return f"the {pb.scope_nodes}-node subgraph around the root cause it was searched on"
    return "this model"


def _runs(pb: PassBisection) -> str:
    return f"{plural(pb.runs, 'run')} of the target to name"


def _listed(nodes: tuple[str, ...], *, code: bool = False) -> str:
    shown = [f"`{n}`" if code else n for n in nodes[:_MAX_LISTED]]
    more = len(nodes) - len(shown)
    return ", ".join(shown) + (f" and {more} more" if more else "")
