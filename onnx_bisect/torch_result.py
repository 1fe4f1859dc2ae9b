"""Result types of a PyTorch-reference run (``--ref pytorch:FILE.py:FACTORY``): each module's
output captured by a forward hook, compared with the ONNX tensor that stands for it on the
target, and the first module that diverges; typed data and the lines they say of themselves
(JSON is ``report.serialize``'s)."""

from __future__ import annotations

from dataclasses import dataclass

from onnx_bisect.compare.criterion import Comparison
from onnx_bisect.text import plural

__all__ = ["ModuleRecord", "TorchRefSummary"]


@dataclass(frozen=True)
class ModuleRecord:
    """One mapped module: its output (torch) against the ONNX tensor that stands for it
    (the last tensor its scope's nodes produce with the same shape), on the target."""

    module: str  # "" for the top module
    class_name: str
    tensor: str
    node: str  # the ONNX node that produces ``tensor``
    op_type: str
    index: int  # that node's position in topological order
    comparison: Comparison


@dataclass(frozen=True)
class TorchRefSummary:
    """What the PyTorch side said: ``modules`` hooked, those ``mapped`` to ONNX tensors (in
    topological order of their tensors), the names of the ``unmapped`` ones (skipped), and the
    first divergent module, innermost first."""

    source: str  # "model.py:make" or the module's class, as given
    modules: int
    mapped: tuple[ModuleRecord, ...]
    unmapped: tuple[str, ...]
    first_module: str | None
    was_training: bool = False
    role: str = "reference"  # what PyTorch is: the reference, or the target under test
    # The ONNX inputs against the module's example inputs: dtype, layout, scale, a line each.
    preprocessing: tuple[str, ...] = ()
    # Inside the first divergent module, where it holds several torch ops (a dynamo export's
    # fx_node metadata, values from torch.export): each op mapped (``module`` its FX name,
    # ``class_name`` its target), how many were not, and the first divergent op.
    ops: tuple[ModuleRecord, ...] = ()
    ops_unmapped: int = 0
    first_op: str | None = None

    @property
    def first(self) -> ModuleRecord | None:
        return next((m for m in self.mapped if m.module == self.first_module), None)

    def lines(self) -> list[str]:
        """What the terminal and report.md say of the PyTorch side, a line each."""
        out = [
            f"{plural(self.modules, 'module')} of {self.source} hooked: "
            f"{sum(1 for m in self.mapped if m.module)} mapped to ONNX tensors, "
            f"{len(self.unmapped)} unmapped (skipped)"
        ]
        first = self.first
        if first is not None:
            cls = f" ({first.class_name})" if first.class_name else ""
            out.append(
                f"first divergent module: {first.module or '(top)'}{cls}, "
                f"ONNX tensor {first.tensor} of node {first.node}"
            )
        elif self.mapped:
            out.append("every mapped module's output agrees with torch")
        if self.ops or self.ops_unmapped:
            op = next((r for r in self.ops if r.module == self.first_op), None)
            said = f"first divergent op: {op.module} ({op.class_name})" if op else "none diverges"
            out.append(
                f"inside {self.first_module or '(top)'}: {plural(len(self.ops), 'torch op')} "
                f"mapped (torch.export), {self.ops_unmapped} unmapped; {said}"
            )
        return out
