"""The pass bisection, as the reports show it: what broke, and the workaround in each form."""

from __future__ import annotations

from onnx_bisect.result import PassBisection, PassOutcome
from onnx_bisect.text import plural

__all__ = ["pass_markdown"]

_MAX_REWRITTEN = 12  # node names listed; the rest are counted
_VERIFIED = "verified: it agrees with the reference"


def pass_markdown(pb: PassBisection) -> list[str]:
    """The "Optimizer pass" section of report.md."""
    out = ["", "**Optimizer pass**", ""]
    if pb.outcome is not PassOutcome.GUILTY:
        return [*out, pb.reason + ".", ""]
    out.append(
        f"`{'` + `'.join(pb.guilty)}` makes the target diverge ({_runs(pb)}; {len(pb.passes)} "
        f"passes rewrite this model: {', '.join(f'`{p}`' for p in pb.passes)})."
    )
    if pb.rewritten:
        out.append(f"It rewrote {_listed(pb.rewritten, code=True)}.")
    if pb.details:  # torch's compiler bisector: backend, subsystem, application, debug info
        out += ["", "| torch.compile | found |", "|---|---|"]
        out += [f"| {what} | `{value}` |" for what, value in pb.details]
    state = _VERIFIED if pb.workaround_verified else "not verified"
    out += ["", f"Workaround ({state}):", "", "| where | how |", "|---|---|"]
    out.append(f"| onnx-bisect | `--target '{pb.workaround}'` |")
    out += [f"| {where} | `{text}` |" for where, text in pb.workaround_forms]
    return [*out, ""]


def _runs(pb: PassBisection) -> str:
    return f"{plural(pb.runs, 'run')} of the target to name"


def _listed(nodes: tuple[str, ...], *, code: bool = False) -> str:
    shown = [f"`{n}`" if code else n for n in nodes[:_MAX_REWRITTEN]]
    more = len(nodes) - len(shown)
    return ", ".join(shown) + (f" and {more} more" if more else "")
