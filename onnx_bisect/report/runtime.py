"""A backend spec as the runtime it names, with its version: what an issue's title says.

A maintainer reads "IREE 3.13.0 (llvm-cpu) cannot run `bn`" at a glance; the spec that found
it (for ``exec:``, a whole command line with paths and ``env`` assignments) belongs in the
body, where the bundle's "Found with" and the environment carry it.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from pathlib import PurePath

from onnx_bisect.backends.spec import parse_spec
from onnx_bisect.errors import SpecError

__all__ = ["env_assignments", "runtime_name"]

# Built-in adapters: what they are called, and the package whose version is theirs.
_RUNTIMES = {
    "ort": ("ONNX Runtime", "onnxruntime"),
    "openvino": ("OpenVINO", "openvino"),
    "tract": ("tract", "tract"),
    "iree": ("IREE", "iree-base-compiler"),
    "tvm": ("TVM", "apache-tvm"),
    "torch": ("torch", "torch"),
    "ref": ("onnx.reference", "onnx"),
}


def runtime_name(spec: str, versions: Mapping[str, str]) -> str:
    """``spec`` as "NAME VERSION (DEVICE)" for a built-in adapter, the program an ``exec:``
    command runs, or the spec itself for anything else."""
    try:
        parsed = parse_spec(spec)
    except SpecError:
        return spec
    suffix = "".join(f" +{t}" for t in parsed.transforms)
    if parsed.name == "exec":
        return _program(parsed.device or "") or spec
    if parsed.name not in _RUNTIMES:
        return spec
    name, package = _RUNTIMES[parsed.name]
    version = versions.get(package)
    device = f" ({parsed.device})" if parsed.device else ""
    return f"{name}{f' {version}' if version else ''}{device}{suffix}"


def env_assignments(spec: str) -> dict[str, str]:
    """The ``NAME=VALUE`` settings an ``exec:env NAME=VALUE … CMD`` spec gives its command."""
    if not spec.startswith("exec:"):
        return {}
    return _split_env(_words(spec.removeprefix("exec:")))[0]


def _split_env(words: list[str]) -> tuple[dict[str, str], list[str]]:
    """A command's ``env`` assignments, and the command ``env`` runs (``words`` as they are
    where it does not start with ``env``)."""
    if not words or PurePath(words[0]).name != "env":
        return {}, words
    assigned: dict[str, str] = {}
    rest = words[1:]
    while rest:
        word = rest[0]
        if word in ("-u", "--unset", "-C", "--chdir", "-S", "--split-string"):
            rest = rest[2:]  # an option with an argument
            continue
        name, sep, value = word.partition("=")
        if word.startswith("-"):
            rest = rest[1:]
        elif sep and name.isidentifier():
            assigned[name] = value
            rest = rest[1:]
        else:
            break
    return assigned, rest


def _program(command: str) -> str | None:
    """What ``command`` runs: past ``env`` and its assignments, past a Python interpreter to
    its script or ``-m`` module."""
    words = _split_env(_words(command))[1]
    if not words:
        return None
    program = PurePath(words[0]).name
    if (program.startswith("python") or program == "{python}") and len(words) > 1:
        if words[1] == "-m" and len(words) > 2:
            return words[2]
        if not words[1].startswith("-"):
            return PurePath(words[1]).name
    return program


def _words(command: str) -> list[str]:
    try:
        return shlex.split(command)
    except ValueError:
        return command.split()
