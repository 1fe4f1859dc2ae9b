"""A ``+transform``'s pass list, as pass control for pass bisection.

``cpu+onnxoptimizer=fuse_bn_into_conv,eliminate_identity`` runs on ``cpu`` the model as those
passes rewrite it (all of onnxoptimizer's fuse-and-elimination passes, when none is named).
Which of them makes it diverge is found as for a runtime's passes, by running subsets: the
spec with ``+onnxoptimizer=<subset>`` applied to the model the target started from, and the
plain runtime (the transform left out) as "every optimization off". So, unlike a runtime's
pass control, each spec runs on its own model: ``model`` gives it (cached, a transform is a
child process).

``+onnxslim`` has a pass list too (its optimizations and fusion patterns, which it takes as
lists to skip); onnxsim has none: its simplify() runs fixed steps.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy.typing as npt
import onnx

from onnx_bisect.backends.passes import Workaround
from onnx_bisect.backends.spec import BackendSpec, parse_spec
from onnx_bisect.transforms.apply import apply_transforms
from onnx_bisect.transforms.registry import parse_transform, transform_kinds

__all__ = ["TransformPasses", "pass_transform"]


def pass_transform(spec: BackendSpec) -> int | None:
    """The index in ``spec.transforms`` of the last transform with a pass list, or None."""
    kinds = transform_kinds()
    found = [i for i, t in enumerate(spec.transforms) if kinds[parse_transform(t).name].passes]
    return found[-1] if found else None


class TransformPasses:
    """Pass control of the ``index``-th transform of ``spec`` (see module); ``source`` is the
    model the target's transforms start from."""

    def __init__(
        self,
        spec: BackendSpec,
        index: int,
        source: onnx.ModelProto,
        shapes: Mapping[str, Sequence[int]],
        done: onnx.ModelProto | None = None,
    ) -> None:
        """``done``: ``source`` after all of ``spec``'s transforms, where already made."""
        self.spec, self.index, self.source, self.shapes = spec, index, source, dict(shapes)
        self.transform = parse_transform(spec.transforms[index])
        self.kind = transform_kinds()[self.transform.name]
        self._models: dict[tuple[str, ...], onnx.ModelProto] = {}
        if done is not None:
            self._models[spec.transforms] = done

    def _with(self, enabled: Sequence[str] | None) -> str:
        """The spec with this transform applying ``enabled`` (None: left out)."""
        ts = list(self.spec.transforms)
        if enabled is None:
            del ts[self.index]
        else:
            ts[self.index] = f"{self.transform.name}={','.join(enabled)}"
        return self.spec.without_transforms().text + "".join(f"+{t}" for t in ts)

    def all_off(self) -> str:
        return self._with(None)

    def passes(self, model: onnx.ModelProto, feeds: Mapping[str, npt.NDArray[Any]]) -> list[str]:
        assert self.kind.passes is not None
        return list(self.kind.passes(self.transform.arg))

    def only(self, enabled: Sequence[str], among: Sequence[str]) -> str:
        # In the list's own order: a pass may need an earlier one to have run. An empty list
        # would mean the default list to onnxoptimizer, so no pass is the transform left out.
        on = [p for p in among if p in enabled]
        return self._with(on if on else None)

    def workaround(self, guilty: Sequence[str]) -> Workaround:
        rest = [p for p in self.passes(self.source, {}) if p not in guilty]
        forms = (("Python", self.kind.python(rest)),) if self.kind.python and rest else ()
        return Workaround(self._with(rest or None), forms)

    def rewritten(self, model: onnx.ModelProto, guilty: Sequence[str]) -> tuple[str, ...]:
        # The source's nodes that survive without the guilty passes but not with them.
        everything = self.passes(model, {})
        with_them = {n.name for n in self.model(self._with(everything)).graph.node}
        fix = self.workaround(guilty).spec
        without = {n.name for n in self.model(fix).graph.node}
        return tuple(n.name for n in self.source.graph.node if n.name in without - with_them)

    def parts(self, name: str, model: onnx.ModelProto) -> list[str] | None:
        return None  # a transform's passes are each one piece

    def model(self, spec: str) -> onnx.ModelProto:
        """The model ``spec`` runs: ``source`` after the spec's transforms."""
        transforms = parse_spec(spec).transforms
        if transforms not in self._models:
            self._models[transforms] = (
                apply_transforms(self.source, transforms, "target", self.shapes)[0]
                if transforms
                else self.source
            )
        return self._models[transforms]
