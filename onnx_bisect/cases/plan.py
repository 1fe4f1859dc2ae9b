"""A sweep's cases: the models found (files or folders), their inputs, the targets with the
folder name each gets, and the ``bisect`` command line that diagnoses one case."""

from __future__ import annotations

import hashlib
import re
import shlex
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from onnx_bisect.backends.registry import check_known
from onnx_bisect.errors import InputError

__all__ = [
    "Case",
    "CaseOptions",
    "ModelEntry",
    "TargetEntry",
    "bisect_args",
    "find_models",
    "parse_targets",
    "plan_cases",
    "repro_command",
    "slug",
]

# The ONNX model zoo's layout: a model's test inputs in test_data_set_N beside it.
TEST_DATA = "test_data_set_0"
_LABEL = re.compile(r"[A-Za-z][A-Za-z0-9_.-]*")


@dataclass(frozen=True)
class ModelEntry:
    name: str  # unique in the sweep: the file's stem, its folder's name before it on a clash
    path: Path
    inputs: Path | None  # an .npz or a test-case folder; None: generated


@dataclass(frozen=True)
class TargetEntry:
    label: str  # what the tables call it
    spec: str
    slug: str  # its folder under each model's


@dataclass(frozen=True)
class CaseOptions:
    """What every case's ``bisect`` gets beside its model and target."""

    ref: str = "cpu"
    shapes: tuple[str, ...] = ()
    timeout: float | None = None  # per target run, bisect's --timeout
    max_memory: int | None = None  # bytes
    isolate_crashes: bool | None = None
    case_timeout: float | None = None  # the whole case; past it the case is a hang
    repro: bool = True


@dataclass(frozen=True)
class Case:
    model: ModelEntry
    target: TargetEntry

    @property
    def key(self) -> tuple[str, str]:
        return (self.model.name, self.target.label)

    @property
    def folder(self) -> str:
        """Relative to the sweep's output directory."""
        return f"{self.model.name}/{self.target.slug}"


def slug(text: str) -> str:
    """A folder name for a target: its spec's letters, digits and ``.+_-``, others as ``-``;
    a long one cut, with a hash of the whole so that two long specs stay apart."""
    plain = re.sub(r"[^A-Za-z0-9.+_-]+", "-", text).strip("-.") or "target"
    if len(plain) <= 40 and plain == text:
        return plain
    digest = hashlib.sha1(text.encode()).hexdigest()[:8]
    return f"{plain[:31].rstrip('-.')}-{digest}"


def parse_targets(texts: Sequence[str]) -> list[TargetEntry]:
    """``--target SPEC`` or ``--target LABEL=SPEC`` (a label names a long exec: spec in the
    tables); each spec parsed here, once, so that a typo is one error before any case runs."""
    if not texts:
        raise InputError("target: give at least one --target SPEC", option="target")
    entries: list[TargetEntry] = []
    for text in texts:
        label, sep, spec = text.partition("=")
        if not (sep and _LABEL.fullmatch(label)):
            label, spec = text, text
        check_known(spec)
        entries.append(TargetEntry(label=label, spec=spec, slug=slug(label)))
    for field in ("label", "slug"):
        twice = [k for k, n in Counter(getattr(e, field) for e in entries).items() if n > 1]
        if twice:
            raise InputError(
                f"target: {twice[0]!r} names two targets; give each its own LABEL=SPEC",
                option="target",
            )
    return entries


def find_models(
    paths: Sequence[Path], *, inputs: Path | None = None, out: Path | None = None
) -> list[ModelEntry]:
    """Every ``.onnx`` file given, or found under a folder given (sorted), named by its stem:
    the zoo's ``resnet50/model.onnx`` and ``vgg16/model.onnx`` are ``resnet50-model`` and
    ``vgg16-model``. Inputs: ``inputs/<name>.npz`` (or ``<stem>.npz``), else the
    ``test_data_set_0`` beside the model, else generated. Nothing under ``out`` is a model:
    an earlier sweep's bundles would be swept as models the next time."""
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            found = sorted(p for p in path.rglob("*.onnx") if p.is_file() and not _under(p, out))
            if not found:
                raise InputError(f"{path}: no .onnx model in this folder")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise InputError(f"{path}: no such model file or folder")
    files = list(dict.fromkeys(p.resolve() for p in files))
    if inputs is not None and not inputs.is_dir():
        raise InputError(f"inputs {inputs}: not a folder of <model>.npz files", option="inputs")
    stems = Counter(p.stem for p in files)
    names: list[str] = []
    for p in files:
        name = p.stem if stems[p.stem] == 1 else f"{p.parent.name}-{p.stem}"
        names.append(name if name not in names else f"{name}-{len(names)}")
    return [
        ModelEntry(name=name, path=p, inputs=_inputs_of(p, name, inputs))
        for name, p in zip(names, files, strict=True)
    ]


def _under(path: Path, folder: Path | None) -> bool:
    return folder is not None and path.resolve().is_relative_to(folder.resolve())


def _inputs_of(model: Path, name: str, inputs: Path | None) -> Path | None:
    if inputs is not None:
        for stem in (name, model.stem):
            if (inputs / f"{stem}.npz").is_file():
                return inputs / f"{stem}.npz"
    beside = model.parent / TEST_DATA
    return beside if beside.is_dir() else None


def plan_cases(models: Sequence[ModelEntry], targets: Sequence[TargetEntry]) -> list[Case]:
    """Every (model, target), models first: a model's cases are neighbours in the tables."""
    return [Case(model=m, target=t) for m in models for t in targets]


def bisect_args(
    case: Case,
    options: CaseOptions,
    out: Path,
    *,
    model: Path | None = None,
    inputs: Path | None = None,
    isolate: bool = False,
) -> list[str]:
    """The ``bisect`` arguments for ``case`` with its reports in ``out``; ``model`` and
    ``inputs`` where the case's files lie elsewhere (a Ray worker's copies); ``isolate`` to
    run the target in a child process (a case whose process died, run again to name where)."""
    given = case.model.inputs if inputs is None else inputs
    args = [str(model or case.model.path), "--ref", options.ref, "--target", case.target.spec]
    if given is not None:
        args += ["--input", str(given)]
    for shape in options.shapes:
        args += ["--shape", shape]
    if options.timeout is not None:
        args += ["--timeout", f"{options.timeout:g}"]
    if options.max_memory is not None:
        args += ["--max-memory", str(options.max_memory)]
    if isolate or options.isolate_crashes:
        args.append("--isolate-crashes")
    elif options.isolate_crashes is False:
        args.append("--no-isolate-crashes")
    if not options.repro:
        args.append("--no-repro")
    return [*args, "--out", str(out)]


def repro_command(case: Case, options: CaseOptions, out: Path, *, isolate: bool = False) -> str:
    """The command that diagnoses this case again, as a user types it."""
    return shlex.join(["bisect", *bisect_args(case, options, out, isolate=isolate)])
