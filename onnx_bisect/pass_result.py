"""The pass bisection's part of a result: which optimizer passes make the target diverge, and
the workaround; a layer below ``result``, whose ``BisectResult.pass_bisection`` holds it."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from onnx_bisect.text import plural

__all__ = ["PassBisection", "PassOutcome", "PassScope", "target_arg"]


_MAX_REWRITTEN = 12  # node names a summary lists; the rest are counted
# A workaround spec longer than this has its longest pass list shortened in the summary (a
# transform's default list less one pass is ~1,000 characters); report.md has it whole.
_LONG_SPEC = 160
_PASS_LIST = re.compile(r"(?<=[=,])[\w.-]+(?:,[\w.-]+){5,}")


class PassOutcome(StrEnum):
    GUILTY = "guilty"  # these passes, enabled alone, make the target diverge
    NOT_OPTIMIZER = "not_optimizer"  # it diverges with every optimization off too
    NO_PASSES = "no_passes"  # the runtime named no pass that rewrites this model
    FAILED = "failed"  # the passes could not be listed


class PassScope(StrEnum):
    SUBGRAPH = "subgraph"  # the subgraph around the root cause, fed the reference's values
    MODEL = "model"  # the whole model


@dataclass(frozen=True)
class PassBisection:
    """Which optimizer passes of the target make it diverge, and how to turn them off."""

    outcome: PassOutcome
    target: str  # the spec whose passes were bisected
    passes: tuple[str, ...] = ()  # the passes that rewrite this model, in applied order
    guilty: tuple[str, ...] = ()
    runs: int = 0  # target runs to name them, the optimizations-off check included
    workaround: str = ""  # the spec with the guilty passes off
    workaround_forms: tuple[tuple[str, str], ...] = ()  # (where, text): Python, C/C++, ...
    workaround_verified: bool = False  # the workaround spec agrees on the whole model
    rewritten: tuple[str, ...] = ()  # the model's nodes the guilty passes replace
    reason: str = ""
    # What torch's compiler bisector adds: (what, text) for backend, subsystem, config,
    # application and debug info; () for other targets.
    details: tuple[tuple[str, str], ...] = ()
    scope: PassScope = PassScope.MODEL  # what the passes were searched on
    scope_nodes: int = 0  # the nodes of that model
    scope_note: str = ""  # why the whole model, where a subgraph was not used
    # A guilty pass made of rules that switch off one by one (ONNX Runtime's rule-based
    # transformers): its name, and those of its rules that change this model's graph.
    parts_of: str = ""
    parts: tuple[str, ...] = ()

    def where(self) -> str:
        """What the passes were searched on, in words."""
        if self.scope is PassScope.SUBGRAPH:
            return f"on the {self.scope_nodes}-node subgraph around the root cause"
        size = f" ({plural(self.scope_nodes, 'node')})" if self.scope_nodes else ""
        note = f": {self.scope_note}" if self.scope_note else ""
        return f"on the whole model{size}{note}"

    def summary(self) -> str:
        """One paragraph: which passes, in how many runs, and the workaround's spec."""
        if self.outcome is not PassOutcome.GUILTY:
            return self.reason
        state = (
            "verified: it agrees with the reference"
            if self.workaround_verified
            else "NOT verified: it still diverges"
        )
        spec = self.workaround
        if len(spec) > _LONG_SPEC:
            spec = _PASS_LIST.sub(_shortened, spec)
            if spec != self.workaround:
                state += "; shortened here, whole in report.md and report.json"
        text = (
            f"{' + '.join(self.guilty)} ({plural(self.runs, 'run')} of the target to name, "
            f"{self.where()}; {self.reason}). Workaround: {target_arg(spec)} ({state})"
        )
        if self.rewritten:
            shown = self.rewritten[:_MAX_REWRITTEN]
            more = len(self.rewritten) - len(shown)
            text += f". It rewrote {', '.join(shown)}" + (f" and {more} more" if more else "")
        if self.details:
            text += ". " + "; ".join(f"{what}: {value}" for what, value in self.details)
        return text

    def to_dict(self) -> dict[str, Any]:
        return {
            "outcome": self.outcome.value,
            "target": self.target,
            "passes": list(self.passes),
            "guilty": list(self.guilty),
            "runs": self.runs,
            "scope": self.scope.value,
            "scope_nodes": self.scope_nodes,
            "scope_note": self.scope_note,
            "parts_of": self.parts_of or None,
            "parts": list(self.parts),
            "workaround": {
                "spec": self.workaround,
                **{where: text for where, text in self.workaround_forms},
                "verified": self.workaround_verified,
            }
            if self.workaround
            else None,
            "rewritten": list(self.rewritten),
            "reason": self.reason,
            "details": dict(self.details),
        }


def target_arg(spec: str) -> str:
    """``--target 'SPEC'`` for a POSIX shell, quoted the shell's way where the spec holds a
    quote of its own (an ``exec:`` command line)."""
    return f"--target {shlex.quote(spec)}" if "'" in spec else f"--target '{spec}'"


def _shortened(match: re.Match[str]) -> str:
    names = match.group(0).split(",")
    return f"{names[0]},{names[1]},…{len(names) - 3} more…,{names[-1]}"
