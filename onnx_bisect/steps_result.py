"""Result types of a multi-step run (``--steps``): each step's outputs compared, the tokens
both sides chose, and the first step that diverged; typed data and the lines they say of
themselves (JSON is ``report.serialize``'s)."""

from __future__ import annotations

from dataclasses import dataclass

from onnx_bisect.compare.criterion import Comparison
from onnx_bisect.text import fmt, plural

__all__ = ["StepRecord", "StepsSummary"]


@dataclass(frozen=True)
class StepRecord:
    """One step: its final outputs compared (the worst one kept), or the target's error."""

    step: int
    diverged: bool
    worst: Comparison | None  # the worst output (None when the target failed)
    failed: str = ""  # the target's error on this step, one line
    ref_token: int | None = None  # the greedy token of each side, where the model has one
    target_token: int | None = None
    # The target picked another token, but the reference's top two logits are closer than
    # the target's error on them: a tie the target's precision decides, not a divergence.
    tie: bool = False

    @property
    def flipped(self) -> bool:
        return (
            self.ref_token is not None
            and self.target_token is not None
            and self.ref_token != self.target_token
        )

    def status(self) -> str:
        if self.failed:
            return "failed"
        if self.diverged:
            return "diverged"
        if self.worst is not None and self.worst.within_precision:
            return "within precision"
        return "ok"


@dataclass(frozen=True)
class StepsSummary:
    """``count`` steps run in lockstep, teacher-forced: both sides get the reference's state
    and token each step, so a step that diverges is a defect of that step, not drift.
    ``free_run``, when asked for, is the same run with each side feeding itself."""

    count: int
    first_divergent_step: int | None
    per_step: tuple[StepRecord, ...]
    wiring: tuple[str, ...]  # how outputs feed the next step's inputs, one line each
    free_run: tuple[StepRecord, ...] | None = None

    @property
    def parted_at(self) -> int | None:
        """The first free-running step at which the two sides chose different tokens (or
        diverged, for a model without tokens)."""
        for s in self.free_run or ():
            if s.flipped or s.diverged or s.failed:
                return s.step
        return None

    def lines(self) -> list[str]:
        """What the terminal and report.md say of the steps, a line each."""
        ties = [s.step for s in self.per_step if s.tie]
        first = self.first_divergent_step
        said = (
            f"{plural(self.count, 'step')} run teacher-forced; "
            + (f"step {first} is the first to diverge" if first is not None else "none diverges")
        )
        if first is not None:
            said += f" (the diagnosis below is of step {first}, on its own inputs)"
        out = [said]
        if ties:
            out.append(
                f"greedy token ties at step {', '.join(map(str, ties))}: the reference's top two "
                "logits are closer than the target's error on them; not a divergence"
            )
        if self.free_run is not None:
            parted = self.parted_at
            out.append(
                f"free run: the two sides part at step {parted}"
                if parted is not None
                else f"free run: the two sides agree over {plural(len(self.free_run), 'step')}"
            )
        return out


def step_error(s: StepRecord) -> str:
    """The worst output's deciding number, for tables."""
    if s.failed or s.worst is None:
        return "-"
    return fmt(s.worst.score)
