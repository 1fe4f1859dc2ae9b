"""ONNX's own backend node tests (written by the ONNX project, shipped in the onnx wheel) run
on ``torch:cpu``, as written and in float64: the evidence behind docs/torch-ops.md.

A case counts when the backend claims every operator version in it; the claim is the
operator table, so an op is listed only once it has an implementation. Run
``python -m onnx_bisect.backends.torch.coverage --write docs/torch-ops.md`` to regenerate
the table, or ``--ops Conv,Resize --failures`` while working on an operator.
"""

from __future__ import annotations

import argparse
import re
import time
import warnings
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
from onnx import numpy_helper

from onnx_bisect.backends.protocol import one_line
from onnx_bisect.backends.spec import parse_spec
from onnx_bisect.backends.torch.context import SUPPORTED_TYPES
from onnx_bisect.backends.torch.ops.registry import UnsupportedOperator, lookup, schema_version

__all__ = [
    "MODES",
    "CaseResult",
    "claimed_versions",
    "node_cases",
    "render",
    "run_cases",
    "unclaimed",
]

MODES = {"float32": "torch:cpu", "float64": "torch:cpu?dtype=float64"}
COMPOSITE = "(function bodies of unclaimed ops)"


@dataclass(frozen=True)
class CaseResult:
    case: str
    mode: str
    versions: tuple[str, ...]  # "Conv-11": every operator version the case uses
    dtypes: tuple[str, ...]  # the element types of its inputs
    passed: bool
    error: str | None = None


@cache
def node_cases() -> tuple[Any, ...]:
    from onnx.backend.test.case.node import collect_testcases

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the case generators overflow casts on purpose
        return tuple(c for c in collect_testcases(None) if c.kind == "node")


def _nodes(graph: onnx.GraphProto) -> Iterable[onnx.NodeProto]:
    for node in graph.node:
        yield node
        for attr in node.attribute:
            for g in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
                yield from _nodes(g)


def _type_supported(t: onnx.TypeProto) -> bool:
    if t.HasField("tensor_type"):
        return t.tensor_type.elem_type in SUPPORTED_TYPES
    if t.HasField("sequence_type"):
        return _type_supported(t.sequence_type.elem_type)
    if t.HasField("optional_type"):
        return _type_supported(t.optional_type.elem_type)
    return False


def _types_supported(model: onnx.ModelProto) -> bool:
    """Every graph input and output is a tensor, a sequence or an optional of a type torch
    has (no string, map): cases of other types test types, not the operator."""
    return all(_type_supported(v.type) for v in [*model.graph.input, *model.graph.output])


def claimed_versions(model: onnx.ModelProto) -> tuple[str, ...] | None:
    """The ``Op-version`` names the case uses, or None when the backend does not claim the case:
    an operator version it lacks, or a tensor type torch has no dtype for."""
    if not _types_supported(model):
        return None
    opsets = {i.domain or "": i.version for i in model.opset_import}
    out = []
    for node in _nodes(model.graph):
        domain = "" if node.domain == "ai.onnx" else node.domain
        if domain not in opsets:
            return None
        try:
            lookup(node.op_type, opsets[domain], domain)
        except UnsupportedOperator:
            return None
        out.append(f"{node.op_type}-{schema_version(node.op_type, opsets[domain], domain)}")
    return tuple(sorted(set(out)))


def _dtype_names(model: onnx.ModelProto) -> tuple[str, ...]:
    names = set()
    for v in model.graph.input:
        if v.type.HasField("tensor_type"):
            names.add(onnx.TensorProto.DataType.Name(v.type.tensor_type.elem_type).lower())
    return tuple(sorted(names))


def _check(actual: Any, expected: Any, mode: str, rtol: float, atol: float) -> str | None:
    if expected is None:  # an empty optional
        return None if actual is None else "an empty optional was expected"
    if isinstance(expected, list):  # a sequence
        if not isinstance(actual, list) or len(actual) != len(expected):
            return f"a sequence of {len(expected)} tensors was expected, not {type(actual)}"
        errors = [_check(a, e, mode, rtol, atol) for a, e in zip(actual, expected, strict=True)]
        return next((e for e in errors if e), None)
    if isinstance(expected, np.generic):  # a few cases store a numpy scalar
        expected = np.asarray(expected)
    if not isinstance(expected, np.ndarray):
        return f"expected a {type(expected).__name__}, which the backend does not produce"
    if actual is None:
        return "no output"
    actual = np.asarray(actual)
    if actual.shape != expected.shape:
        return f"shape {actual.shape} != {expected.shape}"
    exp_kind = "f" if expected.dtype.kind == "V" or "bfloat16" in str(expected.dtype) else None
    floating = (exp_kind or expected.dtype.kind) == "f"
    if mode == "float32" and not floating and actual.dtype != expected.dtype:
        return f"dtype {actual.dtype} != {expected.dtype}"
    bf16_as_f32 = "bfloat16" in str(expected.dtype) and actual.dtype == np.float32
    sized = expected.dtype.itemsize == actual.dtype.itemsize
    if mode == "float32" and floating and not bf16_as_f32 and not sized:
        return f"dtype {actual.dtype} != {expected.dtype}"
    a, e = _comparable(actual), _comparable(expected)
    try:
        np.testing.assert_allclose(a, e, rtol=rtol, atol=atol, equal_nan=True)
    except AssertionError as exc:
        return one_line(exc)[:200]
    return None


def _comparable(array: npt.NDArray[Any]) -> npt.NDArray[Any]:
    if array.dtype.kind in "fV" or "bfloat16" in str(array.dtype):
        return array.astype(np.float64)
    return array


def _array(value: Any) -> Any:
    """Some cases store TensorProto or numpy scalars where others store arrays."""
    if isinstance(value, onnx.TensorProto):
        return numpy_helper.to_array(value)
    if isinstance(value, list):
        return [_array(v) for v in value]
    return np.asarray(value) if isinstance(value, np.generic) else value


def run_case(case: Any, mode: str) -> CaseResult:
    from onnx_bisect.backends.torch.backend import TorchBackend

    versions = claimed_versions(case.model) or ()
    backend = TorchBackend(parse_spec(MODES[mode]))
    names = [v.name for v in case.model.graph.input]
    outputs = [v.name for v in case.model.graph.output]
    try:
        for inputs, expected in case.data_sets:
            feeds = dict(zip(names, map(_array, inputs), strict=False))
            expected = [_array(e) for e in expected]
            # run_compiled without a compiler: the eager run, its sequence outputs as lists
            # (BackendBase.run makes every output one array).
            got = backend.run_compiled(case.model, feeds, None)
            for name, exp in zip(outputs, expected, strict=False):
                error = _check(got.get(name), exp, mode, case.rtol, case.atol)
                if error:
                    return CaseResult(case.name, mode, versions, _dtype_names(case.model),
                                      False, f"{name}: {error}")  # fmt: skip
    except Exception as exc:
        return CaseResult(case.name, mode, versions, _dtype_names(case.model), False,
                          one_line(exc))  # fmt: skip
    return CaseResult(case.name, mode, versions, _dtype_names(case.model), True)


def run_cases(
    ops: Sequence[str] | None = None, modes: Sequence[str] = tuple(MODES)
) -> list[CaseResult]:
    """Every claimed case (of ``ops`` only, when given) in each mode."""
    results = []
    for case in node_cases():
        versions = claimed_versions(case.model)
        if versions is None:
            continue
        if ops and not any(v.rsplit("-", 1)[0] in ops for v in versions):
            continue
        for mode in modes:
            results.append(run_case(case, mode))
    return results


def unclaimed() -> Counter[str]:
    """Why each case the backend does not claim is left out: its first operator the backend
    lacks, or "string/map tensors"."""
    out: Counter[str] = Counter()
    for case in node_cases():
        if claimed_versions(case.model) is not None:
            continue
        if not _types_supported(case.model):
            out["string/map tensors"] += 1
            continue
        opsets = {i.domain or "": i.version for i in case.model.opset_import}
        for node in _nodes(case.model.graph):
            domain = "" if node.domain == "ai.onnx" else node.domain
            try:
                lookup(node.op_type, opsets.get(domain, 0), domain)
            except UnsupportedOperator:
                out[node.op_type] += 1
                break
    return out


def _op_of(case: str, versions: Sequence[str]) -> str:
    """The operator a case tests: its single op, or the one its name starts with."""
    ops = sorted({v.rsplit("-", 1)[0] for v in versions})
    if len(ops) == 1:
        return ops[0]
    snake = case.removeprefix("test_").replace("_", "")
    for op in sorted(ops, key=len, reverse=True):
        if snake.startswith(op.lower()):
            return op
    # e.g. test_attention_*_expanded: a function op the backend does not claim, as its body
    return COMPOSITE


def render(results: Sequence[CaseResult], seconds: float) -> str:
    """docs/torch-ops.md: totals, then one row per operator."""
    import torch

    rows: dict[str, dict[str, Any]] = defaultdict(
        lambda: {"versions": set(), "dtypes": set(), "passed": defaultdict(int), "total": 0}
    )
    for r in results:
        op = _op_of(r.case, r.versions)
        row = rows[op]
        row["versions"] |= {int(v.rsplit("-", 1)[1]) for v in r.versions if v.startswith(f"{op}-")}
        row["dtypes"] |= set(r.dtypes)
        row["passed"][r.mode] += r.passed
        if r.mode == "float32":
            row["total"] += 1
    lines = [
        "# Operators of the torch backend",
        "",
        "Generated by `python -m onnx_bisect.backends.torch.coverage --write docs/torch-ops.md`",
        "(tests/test_torch_ops.py checks it is current). Each row counts ONNX's own backend node",
        f"test cases (onnx {onnx.__version__}) of the operator that use only operators and types",
        f"the backend claims, run on `torch:cpu` (torch {torch.__version__}) as written (float32",
        "column) and with every floating tensor in float64 (float64 column), against the",
        "expected outputs at each case's tolerance. In float64 a case whose point is rounding",
        "(a Cast to bfloat16, a bfloat16 Celu, bfloat16 Attention at a 1e-3 tolerance) cannot",
        "pass: the policy computes in float64 (float8, float4 and int4 keep their rounding:",
        "they are quantized data). Training losses and optimizers are included (they pass);",
        "nothing is excluded.",
        "",
    ]
    for mode in MODES:
        done = [r for r in results if r.mode == mode]
        passed = sum(r.passed for r in done)
        share = 100 * passed / max(len(done), 1)
        lines.append(f"- {mode}: {passed} of {len(done)} cases pass ({share:.1f}%)")
    total = len(node_cases())
    claimed = len({r.case for r in results})
    for mode in MODES:
        passed = sum(r.passed for r in results if r.mode == mode)
        lines.append(
            f"- {mode}, of all onnx's node cases: {passed} of {total} ({100 * passed / total:.1f}%)"
        )
    why = ", ".join(f"{k} {n}" for k, n in unclaimed().most_common())
    lines += [
        f"- operators: {len(rows) - (COMPOSITE in rows)}; the run took {seconds:.0f} s",
        f"- not claimed: {total - claimed} of onnx's {total} node cases use an operator the",
        f"  backend does not implement, or a type it lacks: {why}",
        "",
        "| operator | versions | input types | cases | float32 | float64 |",
        "|---|---|---|---:|---:|---:|",
    ]
    for op in sorted(rows, key=lambda o: (o == COMPOSITE, o)):
        row = rows[op]
        versions = ", ".join(str(v) for v in sorted(row["versions"]))
        lines.append(
            f"| {op} | {versions} | {', '.join(sorted(row['dtypes']))} | {row['total']} | "
            f"{row['passed']['float32']} | {row['passed']['float64']} |"
        )
    failed = [r for r in results if not r.passed]
    if failed:
        lines += ["", "## Cases that fail", "", "| case | mode | why |", "|---|---|---|"]
        for r in failed:
            why = re.sub(r"\s+", " ", r.error or "").replace("|", "\\|")[:160]
            lines.append(f"| {r.case} | {r.mode} | {why} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", help="comma-separated operators to run (default: all)")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--failures", action="store_true", help="print each failing case")
    parser.add_argument("--write", help="write the markdown table to this path")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    results = run_cases(args.ops.split(",") if args.ops else None, args.modes.split(","))
    seconds = time.perf_counter() - start
    for mode in args.modes.split(","):
        done = [r for r in results if r.mode == mode]
        print(f"{mode}: {sum(r.passed for r in done)} of {len(done)} pass")
    if args.failures:
        for r in results:
            if not r.passed:
                print(f"FAIL {r.case} [{r.mode}]: {r.error}")
    if args.write:
        with open(args.write, "w", encoding="utf-8") as f:
            f.write(render(results, seconds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
