"""``exec:COMMAND``: any runtime in any language, through files.

Protocol (docs/exec-protocol.md): we write ``model.onnx`` (the probes already marked as graph
outputs; external weights in ``model.onnx.data``, shared with the model's weight file when
large: a clone or a link to a private copy, never a link to the user's file) and
``inputs.npz`` keyed by graph input name into a fresh temporary directory, substitute
``{model}``, ``{inputs}`` and ``{outputs}`` in COMMAND (and ``{python}``, the interpreter running
onnx-bisect, so that ``exec:{python} my_runtime.py ...`` runs in this environment whatever
``python`` the shell finds first), run it without a shell (shlex-split),
and read ``outputs.npz`` keyed by graph output name. A non-zero exit or a missing output is a
backend failure. A stderr line ``onnx-bisect-capability: compiles`` (of any run, failed or not)
declares that each run compiles the model: from then on the searches count its runs as
compiles (``Capabilities.compiles``), which only the program itself can know.
"""

from __future__ import annotations

import logging
import re
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy.typing as npt
import onnx

from onnx_bisect.backends.passes import PassControl, Workaround
from onnx_bisect.backends.protocol import BackendBase, Capabilities, Tensors
from onnx_bisect.backends.spec import BackendSpec
from onnx_bisect.errors import BackendCrash, BackendError, InputError, SpecError
from onnx_bisect.graph.save import save_model
from onnx_bisect.inputs.feeds import save_npz
from onnx_bisect.inputs.npz import read_npz
from onnx_bisect.process import run_child

__all__ = [
    "CAPABILITY_PREFIX", "DECLARABLE", "DISABLE", "NOTE_PREFIX", "PYTHON", "ExecBackend",
    "ExecPasses", "PLACEHOLDERS", "exited", "hint",
]  # fmt: skip

log = logging.getLogger(__name__)


PLACEHOLDERS = ("{model}", "{inputs}", "{outputs}")
# Optional: replaced by the comma-separated passes to turn off ("" for none); with the names
# declared by --passes, it lets pass bisection find which of the runtime's passes breaks it.
DISABLE = "{disable}"
# Optional: replaced by the interpreter running onnx-bisect (``sys.executable``). A command's
# bare ``python`` is whichever the PATH finds first, often not the one with onnx and numpy.
PYTHON = "{python}"
# A stderr line of a successful run that starts with this becomes a note in the report (a
# lowered IR version, a fallback the runtime took): what the user should know about the run.
NOTE_PREFIX = "onnx-bisect-note:"
# A stderr line that starts with this declares what the program is (docs/exec-protocol.md):
# the capabilities in ``DECLARABLE``, by name, separated by spaces or commas.
CAPABILITY_PREFIX = "onnx-bisect-capability:"
# What a program may declare of itself. ``compiles``: each run compiles the model (an ML
# compiler), so the searches spare runs. The rest of ``Capabilities`` is the tool's to know.
DECLARABLE = ("compiles",)


_STDERR_TAIL = 5


class ExecBackend(BackendBase):
    capabilities = Capabilities(child_process=True, process_per_run=True)
    # How the model is written for the command: for any program, weights beside it.
    save = staticmethod(save_model)

    def __init__(self, spec: BackendSpec, timeout: float | None = None) -> None:
        super().__init__(spec)
        self.timeout = timeout
        command = spec.device or ""
        try:
            self.argv = shlex.split(command)
        except ValueError as exc:
            raise SpecError(f"backend {spec.text!r}: cannot split the command ({exc})") from None
        if not self.argv:
            raise SpecError("exec: needs a command, e.g. exec:'./myrt {model} {inputs} {outputs}'")
        missing = [p for p in PLACEHOLDERS if p not in command]
        if missing:
            raise SpecError(
                f"backend {spec.text!r}: the command must contain {', '.join(PLACEHOLDERS)} "
                f"(missing {', '.join(missing)})"
            )

    def _run(self, model: onnx.ModelProto, feeds: Mapping[str, npt.NDArray[Any]]) -> Tensors:
        with tempfile.TemporaryDirectory(prefix="onnx-bisect-exec-") as tmp:
            d = Path(tmp)
            paths = {
                "{model}": str(self.save(model, d)),
                "{inputs}": str(d / "inputs.npz"),
                "{outputs}": str(d / "outputs.npz"),
            }
            wanted = {i.name for i in model.graph.input}
            save_npz(Path(paths["{inputs}"]), {k: v for k, v in feeds.items() if k in wanted})
            paths[DISABLE] = ""  # passes a pass bisection turns off are spelled into the spec
            paths[PYTHON] = sys.executable
            argv = [_substitute(a, paths) for a in self.argv]
            try:
                proc = run_child(argv, timeout=self.timeout, env=self.environment())
            except FileNotFoundError:
                missing = f"{self.spec.text}: command not found: {argv[0]}"
                raise BackendError(missing + self._hint(missing)) from None
            except subprocess.TimeoutExpired:
                hang = f"{self.spec.text}: timed out after {self.timeout:.3g} s"
                raise BackendCrash(hang) from None
            self._declared(_text(proc.stderr))
            stderr = _undeclared(proc.stderr)
            if proc.returncode != 0:
                said = _text(stderr) or "(no stderr)"
                raise exited(self.spec.text, proc.returncode, stderr, hinted=self._hint(said))
            out_path = Path(paths["{outputs}"])
            if not out_path.exists():
                raise BackendError(
                    f"{self.spec.text}: exited 0 but wrote no {out_path.name}: {_tail(stderr)}"
                )
            for line in _text(stderr).splitlines():
                if line.startswith(NOTE_PREFIX):
                    self._note(line.removeprefix(NOTE_PREFIX).strip(), once=True)
            # Only the outputs asked for: an extra array is never read (the protocol ignores
            # it), and each is checked against the machine from its header first.
            wanted_out = {o.name for o in model.graph.output}
            try:
                return read_npz(out_path, wanted_out, what=self.spec.text)
            except InputError as exc:
                raise BackendError(str(exc)) from None

    def _declared(self, stderr: str) -> None:
        """Take the capabilities the program declares on stderr (see ``CAPABILITY_PREFIX``)."""
        for line in stderr.splitlines():
            if not line.startswith(CAPABILITY_PREFIX):
                continue
            for word in line.removeprefix(CAPABILITY_PREFIX).replace(",", " ").split():
                if word not in DECLARABLE:
                    log.warning(
                        "%s declares %r, which is not a capability onnx-bisect knows "
                        "(known: %s); ignored", self.spec.text, word, ", ".join(DECLARABLE),
                    )  # fmt: skip
                elif not self.capabilities.compiles:
                    log.info("%s declares that each run compiles the model", self.spec.text)
                    self.capabilities = replace(self.capabilities, compiles=True)

    def pass_control(self, declared: Sequence[str]) -> PassControl | None:
        """Its passes, when its command takes ``{disable}`` and the user named them."""
        if DISABLE not in (self.spec.device or "") or not declared:
            return None
        return ExecPasses(self.spec, declared)

    def environment(self) -> dict[str, str] | None:
        """The child's environment; None inherits ours."""
        return None

    def _hint(self, said: str) -> str:
        return hint(said, self.argv)

    def describe(self) -> str:
        # Quoted so that a path with a space reads unambiguously; placeholders stay readable.
        words = (a if a in (*PLACEHOLDERS, PYTHON) else shlex.quote(a) for a in self.argv)
        return "exec: " + " ".join(words)


class ExecPasses:
    """Pass control of an ``exec:`` runtime: ``{disable}`` spelled out in its command."""

    def __init__(self, spec: BackendSpec, declared: Sequence[str]) -> None:
        self.spec, self.declared = spec, list(declared)

    def all_off(self) -> str:
        return self._spec(self.declared)

    def passes(self, model: onnx.ModelProto, feeds: Mapping[str, npt.NDArray[Any]]) -> list[str]:
        return list(self.declared)  # which of them rewrite this model, only the runtime knows

    def only(self, enabled: Sequence[str], among: Sequence[str]) -> str:
        return self._spec([p for p in self.declared if p not in enabled])

    def workaround(self, guilty: Sequence[str]) -> Workaround:
        spec = self._spec(guilty)
        return Workaround(spec, (("command", spec.removeprefix("exec:")),))

    def rewritten(self, model: onnx.ModelProto, guilty: Sequence[str]) -> tuple[str, ...]:
        return ()

    def parts(self, name: str, model: onnx.ModelProto) -> list[str] | None:
        return None  # --passes declares a flat list

    def _spec(self, off: Sequence[str]) -> str:
        return self.spec.text.replace(DISABLE, ",".join(off))


# What a program says when the interpreter or the program itself is not the one meant: a
# module missing from the Python that runs it, or a shell that cannot find a command.
_WRONG_PROGRAM = re.compile(
    r"ModuleNotFoundError|No module named|command not found|: not found$", re.MULTILINE
)


def hint(said: str, argv: Sequence[str]) -> str:
    """A sentence to add to a failure that looks like the wrong program ran ("" otherwise)."""
    if not _WRONG_PROGRAM.search(said):
        return ""
    if any(PYTHON in a for a in argv):
        return f" (hint: {PYTHON} is {sys.executable}; install what the runtime needs there)"
    here = f"exec:{PYTHON} SCRIPT ... runs a Python script with {sys.executable}"
    if "command not found" in said:
        return f" (hint: give the program's path; {here})"
    return (
        " (hint: a command's `python` is the first on PATH, not necessarily the Python running "
        f"onnx-bisect; {here})"
    )


def _substitute(arg: str, paths: Mapping[str, str]) -> str:
    for key, value in paths.items():
        arg = arg.replace(key, value)
    return arg


def _undeclared(raw: bytes) -> bytes:
    """stderr without the program's declarations: what it said about the run."""
    prefix = CAPABILITY_PREFIX.encode()
    return b"\n".join(ln for ln in raw.splitlines() if not ln.startswith(prefix))


def exited(spec: str, code: int, stderr: bytes, hinted: str = "") -> BackendError:
    """The error of a child that exited with ``code`` (negative: killed by that signal, which
    is a crash, not an error it reported), with the last of what it said and ``hinted``, a
    sentence on what to fix (see ``hint``)."""
    status = f"signal {-code}" if code < 0 else f"code {code}"
    error = BackendCrash if code < 0 else BackendError
    said = _text(stderr) or "(no stderr)"
    return error(
        f"{spec}: exited with {status}: {_tail(stderr)}{hinted}",
        detail=f"{spec}: exited with {status}:\n{said}{hinted}",
    )


def _tail(raw: bytes) -> str:
    lines = [ln for ln in _text(raw).splitlines() if ln.strip()]
    return " | ".join(lines[-_STDERR_TAIL:]) or "(no stderr)"


def _text(raw: bytes, limit: int = 20_000) -> str:
    """The child's stderr for a finding: all of it, or its last ``limit`` characters."""
    # Runtimes log in whatever encoding they like; the message must survive any of them.
    text = raw.decode("utf-8", errors="replace").strip()
    return text if len(text) <= limit else "…" + text[-limit:]
