"""Result types of a sweep (``onnx-bisect sweep``): one ``CaseResult`` per (model, target), the
``SweepResult`` table of them, and a baseline's comparison. Typed data, as a ``BisectResult``
is for one run; ``report/`` renders it (results.csv, junit.xml, summary.md/.html)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import Any

from onnx_bisect.text import plural

__all__ = [
    "BASELINE_SCHEMA",
    "BaselineDiff",
    "CaseOutcome",
    "CaseResult",
    "Change",
    "Stage",
    "SweepResult",
    "baseline_dict",
    "compare_baseline",
    "is_worse",
    "read_baseline_dict",
]

BASELINE_SCHEMA = "onnx-bisect/sweep-baseline/v1"


class CaseOutcome(StrEnum):
    """How one (model, target) case ended. ``agree``: the final outputs match; ``precision``:
    they differ within what a lower precision the runtime chose (or quantization) predicts;
    ``diverged``: a node computes wrongly; ``unsupported``: the target cannot run a node;
    ``crash``: the target (or the case's process) died by a signal; ``hang``: it ran past a
    timeout; ``error``: any other failure (the target's error, a model that does not load)."""

    AGREE = "agree"
    PRECISION = "precision"
    DIVERGED = "diverged"
    UNSUPPORTED = "unsupported"
    CRASH = "crash"
    HANG = "hang"
    ERROR = "error"


# Better to worse, for baselines: a case fails the gate only when its rank rises, or when it
# agreed before and no longer does (agree -> precision is a change worth a look too).
_RANK = {
    CaseOutcome.AGREE: 0,
    CaseOutcome.PRECISION: 0,
    CaseOutcome.DIVERGED: 1,
    CaseOutcome.UNSUPPORTED: 1,
    CaseOutcome.CRASH: 2,
    CaseOutcome.HANG: 2,
    CaseOutcome.ERROR: 2,
}
PASSING = (CaseOutcome.AGREE, CaseOutcome.PRECISION)


def is_worse(before: CaseOutcome, after: CaseOutcome) -> bool:
    """Whether ``after`` is a regression from ``before``."""
    if before is CaseOutcome.AGREE and after is not CaseOutcome.AGREE:
        return True
    return _RANK[after] > _RANK[before]


class Stage(StrEnum):
    """Where a case stopped: the model did not ``load`` (or its inputs, or the backend); the
    target could not ``convert`` it (a missing op, a +transform); a compiler failed to
    ``compile`` it; the target failed to ``run`` it (an error, a crash, a hang); or every step
    ran and ``numerics`` decided (agree, precision, diverged)."""

    LOAD = "load"
    CONVERT = "convert"
    COMPILE = "compile"
    RUN = "run"
    NUMERICS = "numerics"


@dataclass(frozen=True)
class CaseResult:
    """One (model, target) case. Paths are relative to the sweep's output directory."""

    model: str  # the model's name in the sweep (its file's stem, made unique)
    target: str  # the target's label (its spec, or the LABEL of --target LABEL=SPEC)
    outcome: CaseOutcome
    stage: Stage
    root_kind: str = ""  # the root cause's kind (CauseKind), "" where there is none
    root_nodes: tuple[str, ...] = ()
    root_ops: tuple[str, ...] = ()  # the op type of each root node
    first_divergence: str = ""  # the first divergent node
    reason: str = ""  # the root-cause line, or the error's
    seconds: float = 0.0
    peak_memory: int | None = None  # bytes, the case's process tree at its peak (sampled)
    folder: str = ""  # the case's folder
    report: str = ""  # its report.md, where bisect wrote one
    bundle: str = ""  # its repro bundle's folder, where one was written
    command: str = ""  # the bisect command that reproduces the case
    exit_code: int | None = None  # the case's bisect process's; a negative signal number
    spec: str = ""  # the target's spec

    @property
    def key(self) -> tuple[str, str]:
        return (self.model, self.target)

    @property
    def passed(self) -> bool:
        return self.outcome in PASSING

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["root_nodes"], out["root_ops"] = list(self.root_nodes), list(self.root_ops)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CaseResult:
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        values["outcome"] = CaseOutcome(values["outcome"])
        values["stage"] = Stage(values["stage"])
        values["root_nodes"] = tuple(values.get("root_nodes", ()))
        values["root_ops"] = tuple(values.get("root_ops", ()))
        return cls(**values)

    def __repr__(self) -> str:
        where = f" at {', '.join(self.root_nodes)}" if self.root_nodes else ""
        return f"<CaseResult {self.model} x {self.target}: {self.outcome}{where}>"


class Change(StrEnum):
    """A case against its baseline."""

    REGRESSION = "regression"  # worse than the baseline (is_worse)
    FIXED = "fixed"  # failed in the baseline, passes now
    UNCHANGED = "unchanged"  # failed in both, no worse
    NEW = "new"  # not in the baseline


@dataclass(frozen=True)
class BaselineDiff:
    """Each case's outcome before (the baseline's) and now, by change."""

    path: str
    before: Mapping[tuple[str, str], CaseOutcome]
    changes: Mapping[tuple[str, str], Change]

    def keys(self, change: Change) -> list[tuple[str, str]]:
        return [key for key, c in self.changes.items() if c is change]


def compare_baseline(
    cases: Sequence[CaseResult], before: Mapping[tuple[str, str], CaseOutcome], path: str
) -> BaselineDiff:
    """Each case against its baseline outcome. A case the baseline lacks is ``new``, and counts
    as a regression when it fails (no outcome of it was ever accepted)."""
    changes: dict[tuple[str, str], Change] = {}
    for case in cases:
        old = before.get(case.key)
        if old is None:
            changes[case.key] = Change.REGRESSION if not case.passed else Change.NEW
        elif is_worse(old, case.outcome):
            changes[case.key] = Change.REGRESSION
        elif old not in PASSING and case.passed:
            changes[case.key] = Change.FIXED
        elif not case.passed:
            changes[case.key] = Change.UNCHANGED
    return BaselineDiff(path=path, before=dict(before), changes=changes)


def baseline_dict(cases: Sequence[CaseResult]) -> dict[str, Any]:
    """What ``--write-baseline`` writes: each case's outcome (and where it stopped, to read)."""
    return {
        "schema": BASELINE_SCHEMA,
        "cases": [
            {
                "model": c.model,
                "target": c.target,
                "outcome": c.outcome.value,
                "root_nodes": list(c.root_nodes),
            }
            for c in cases
        ],
    }


def read_baseline_dict(data: Any) -> dict[tuple[str, str], CaseOutcome]:
    """The outcomes of a baseline file's JSON; ``ValueError`` naming what is wrong."""
    if not isinstance(data, dict) or data.get("schema") != BASELINE_SCHEMA:
        raise ValueError(f"not a sweep baseline (its schema is not {BASELINE_SCHEMA!r})")
    out: dict[tuple[str, str], CaseOutcome] = {}
    for entry in data.get("cases", []):
        try:
            out[(str(entry["model"]), str(entry["target"]))] = CaseOutcome(entry["outcome"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"a case entry without model, target and outcome: {entry!r}") from None
    return out


@dataclass(frozen=True)
class SweepResult:
    """Every case of a sweep, in models x targets order, and the baseline's comparison."""

    cases: tuple[CaseResult, ...]
    models: tuple[str, ...]
    targets: tuple[str, ...]
    ref: str
    out: str
    seconds: float = 0.0
    baseline: BaselineDiff | None = None
    resumed: tuple[tuple[str, str], ...] = ()  # cases read back from a killed sweep
    specs: Mapping[str, str] = field(default_factory=dict)  # target label -> spec

    def case(self, model: str, target: str) -> CaseResult | None:
        return next((c for c in self.cases if c.key == (model, target)), None)

    @property
    def failed(self) -> bool:
        """The gate: with a baseline, whether any case is worse than it; without, whether any
        case does not pass (diverged, unsupported, crash, hang, error)."""
        if self.baseline is not None:
            return bool(self.baseline.keys(Change.REGRESSION))
        return any(not c.passed for c in self.cases)

    def counts(self) -> dict[CaseOutcome, int]:
        found = {o: sum(c.outcome is o for c in self.cases) for o in CaseOutcome}
        return {o: n for o, n in found.items() if n}

    def summary(self) -> list[str]:
        """The lines the terminal prints."""
        tally = ", ".join(f"{n} {o}" for o, n in self.counts().items())
        lines = [
            f"{plural(len(self.cases), 'case')} ({plural(len(self.models), 'model')} x "
            f"{plural(len(self.targets), 'target')}) in {self.seconds:.1f} s: {tally}"
        ]
        for c in self.cases:
            if not c.passed:
                where = f" at {', '.join(c.root_nodes)}" if c.root_nodes else ""
                lines.append(f"  {c.model} x {c.target}: {c.outcome} ({c.stage}){where}")
        if self.baseline is not None:
            for change, what in ((Change.REGRESSION, "new regressions"), (Change.FIXED, "fixed")):
                keys = self.baseline.keys(change)
                if keys:
                    names = ", ".join(f"{m} x {t}" for m, t in keys)
                    lines.append(f"{what} ({len(keys)}): {names}")
        return lines

    def __repr__(self) -> str:
        return f"<SweepResult {len(self.cases)} cases, {'failed' if self.failed else 'passed'}>"
