"""Run the examples in docs/*.md, so the docs cannot drift from the code.

Conventions (what a docs author writes):

- Every document runs in its own fresh working directory, in which ``examples/`` links to the
  repository's ``examples/``; blocks run top to bottom and share one Python namespace.
- The directory of ``sys.executable`` comes first on PATH, so ``python``, ``bisect`` and
  ``onnx-bisect`` in a command are this interpreter and its console scripts. COLUMNS=140.
- ```console blocks: a line starting with ``$ `` is a command for bash (a trailing ``\\``
  continues it). The lines up to the next ``$ `` are its expected stdout+stderr, matched like a
  doctest with ELLIPSIS and NORMALIZE_WHITESPACE (``...`` matches anything); no lines, no check.
  A command must exit 0 unless the next command is ``$ echo $?`` followed by the expected code.
  (How the test runs a command, not what the author writes: a ``bisect`` or ``onnx-bisect``
  line that uses no shell feature runs its console script's function in the test's process, as
  the script would, see ``run_script``; the first such line of each script in each document,
  and every line with a shell feature, runs in bash.)
- ```pycon blocks run as doctests (ELLIPSIS, NORMALIZE_WHITESPACE).
- ```python blocks are executed; one whose first line is ``# file: NAME`` is written to NAME in
  the working directory instead (which is on sys.path, so later blocks can import it).
- ``<!-- test: requires NAME -->`` on the line before a fence skips that block unless NAME (a
  key of REQUIREMENTS) holds on this machine (reported as a pytest skip). Other fences (text,
  shell, toml, json) never run.

Each test item runs one block, or the few blocks that share state (see ``group_blocks``: a
block that reads a name or a file an earlier block made runs after it, in the same fresh
session), so every item is self-contained and every block still runs exactly once.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import doctest
import importlib
import importlib.util
import io
import json
import logging
import os
import re
import shlex
import subprocess
import sys
import tempfile
import tomllib
import traceback
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import typer

import onnx_bisect
from onnx_bisect import Verdict
from onnx_bisect.backends import ALIASES, adapters
from onnx_bisect.backends.ort import PROVIDERS
from onnx_bisect.cli import EXIT_DIVERGED, EXIT_INTERNAL, EXIT_MATCH, EXIT_USAGE, bisect_app

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
BIN = Path(sys.executable).parent
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
RUNNABLE = ("console", "pycon", "python")
# Variables that would make rich colour or size its output differently from the docs.
_TERMINAL_ENV = ("FORCE_COLOR", "NO_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "COLUMNS")
GUIDE_DOCS = (
    "guide.md",
    "api.md",
    "backends.md",
    "adapters.md",
    "exec-protocol.md",
    "report-format.md",
    "steps.md",
)
# Every document whose examples run: the docs, and the README's "Your model" block.
README = "../README.md"
RUN_DOCS = (*GUIDE_DOCS, README)
YOLO = ROOT / "examples" / "models" / "yolo_like.onnx"
FAULTY_RUNTIME = ROOT / "examples" / "faulty_runtime.py"


def _openvino_default_bf16() -> bool:
    if importlib.util.find_spec("openvino") is None:
        return False
    import openvino as ov

    hint = ov.Core().get_property("CPU", "INFERENCE_PRECISION_HINT")
    return "bf16" in str(hint).lower() or "bfloat16" in str(hint).lower()


def _torch_cuda() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


REQUIREMENTS: dict[str, Callable[[], bool]] = {
    "openvino": lambda: importlib.util.find_spec("openvino") is not None,
    "openvino-bf16": _openvino_default_bf16,
    "torch": lambda: importlib.util.find_spec("torch") is not None,
    "tract": lambda: importlib.util.find_spec("tract") is not None,
    "onnxconverter-common": lambda: importlib.util.find_spec("onnxconverter_common") is not None,
    "onnxoptimizer": lambda: importlib.util.find_spec("onnxoptimizer") is not None,
    "not-macos": lambda: sys.platform != "darwin",
    "cuda": _torch_cuda,
    "no-cuda": lambda: importlib.util.find_spec("torch") is not None and not _torch_cuda(),
    "fp16-and-torch": lambda: all(
        importlib.util.find_spec(m) is not None for m in ("onnxconverter_common", "torch")
    ),
    "openvino-and-torch": lambda: all(
        importlib.util.find_spec(m) is not None for m in ("openvino", "torch")
    ),
    "every-backend": lambda: all(
        importlib.util.find_spec(m) is not None
        for m in ("openvino", "torch", "tract", "iree.compiler", "iree.runtime", "tvm")
    ),
}


@dataclass(frozen=True)
class Block:
    doc: str
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    requires: str | None

    @property
    def where(self) -> str:
        return f"{(Path('docs') / self.doc).as_posix().removeprefix('docs/../')}:{self.line}"


def parse_blocks(path: Path) -> list[Block]:
    blocks: list[Block] = []
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m[1]
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        prev = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        req = re.fullmatch(r"<!--\s*test:\s*requires\s+(\S+)\s*-->", prev.strip())
        text = "\n".join(lines[start + 1 : end]) + "\n"
        blocks.append(Block(path.name, start + 1, lang, text, req[1] if req else None))
        i = end + 1
    return blocks


def parse_console(text: str) -> list[tuple[str, str]]:
    """[(command, expected output)] from a console block."""
    steps: list[tuple[str, list[str]]] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("$ "):
            cmd = line[2:]
            while cmd.endswith("\\") and i + 1 < len(lines):
                i += 1
                cmd = cmd[:-1] + " " + lines[i].strip()
            steps.append((cmd, []))
        elif steps:
            steps[-1][1].append(line)
        else:
            raise AssertionError(f"console block must start with '$ ': {line!r}")
        i += 1
    return [(cmd, "\n".join(out).strip("\n") + "\n" if any(out) else "") for cmd, out in steps]


# --- console commands run in this process ---------------------------------------------------
# A ``bisect`` line in bash pays an interpreter's start and the imports of onnxruntime, onnx,
# pandas and typer (about a second of CPU) before it does anything; the docs have about 70.
# One that uses no shell feature runs here instead, through the very function its console
# script calls, with the command's environment, working directory, argv, fresh logging and
# warning filters, and stdout, stderr and the file descriptors 1 and 2 caught together.

# Outside quotes: pipes, lists, redirections, subshells, expansions, globs, comments, escapes.
_SHELL_OUTSIDE_QUOTES = frozenset("|&;<>()$`*?[]{}~#!\\")
_SHELL_IN_DOUBLE_QUOTES = frozenset("$`\\!")
_PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
SCRIPTS: dict[str, str] = _PROJECT["scripts"]  # console script -> "module:function"


def script_argv(cmd: str) -> list[str] | None:
    """``[script, *args]`` for a command line that only runs a console script of ours with
    literal words (quoted or not); None where bash would do more than split the line."""
    quote = ""
    for ch in cmd:
        if quote == "'":
            quote = "" if ch == "'" else quote
        elif quote == '"':
            if ch in _SHELL_IN_DOUBLE_QUOTES:
                return None
            quote = "" if ch == '"' else quote
        elif ch in "'\"":
            quote = ch
        elif ch in _SHELL_OUTSIDE_QUOTES:
            return None
    if quote:
        return None
    words = shlex.split(cmd)
    return words if words and words[0] in SCRIPTS else None


def _bash_first(doc: str) -> set[tuple[int, int]]:
    """(block line, command index) of the first line of each console script in ``doc``: those
    stay in bash, so every document shows its real commands working as written."""
    first: dict[str, tuple[int, int]] = {}
    for block in runnable_blocks(doc):
        if block.lang == "console":
            for k, (cmd, _) in enumerate(parse_console(block.text)):
                words = cmd.split()
                if words and words[0] in SCRIPTS:
                    first.setdefault(words[0], (block.line, k))
    return set(first.values())


# Python's own filters in a fresh interpreter (no -W, no PYTHONWARNINGS), first match wins.
_FRESH_FILTERS = (
    ("default", DeprecationWarning, "__main__"),
    ("ignore", DeprecationWarning, ""),
    ("ignore", PendingDeprecationWarning, ""),
    ("ignore", ImportWarning, ""),
    ("ignore", ResourceWarning, ""),
)


def _show_on_stderr(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: Any = None,
    line: str | None = None,
) -> None:
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


@contextlib.contextmanager
def _fds_to(path: Path) -> Iterator[None]:
    """File descriptors 1 and 2 (a runtime's C++ logging, children that inherit them) to
    ``path`` meanwhile."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with path.open("wb") as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)


def run_script(argv: list[str], env: Mapping[str, str], cwd: Path) -> tuple[int, str]:
    """Run ``argv`` (a console script of ours and its arguments) in this process as the script
    would run in its own: its entry point called with ``sys.argv`` set, ``os.environ`` =
    ``env``, in ``cwd``, the root logger without handlers, Python's default warning filters;
    the exit code
    (a traceback and 1 for an exception), and stdout and stderr together, then whatever
    reached the file descriptors 1 and 2 (in its own process it would be in order with the
    rest, so a doc must not show a command's C++ logging between its Python lines)."""
    module, _, func = SCRIPTS[argv[0]].partition(":")
    entry = getattr(importlib.import_module(module), func)
    text = io.StringIO()
    root = logging.getLogger()
    saved_env, saved_argv, saved_cwd = dict(os.environ), sys.argv, os.getcwd()
    saved_handlers, saved_level = root.handlers[:], root.level
    with tempfile.TemporaryDirectory() as tmp:
        fd_text = Path(tmp) / "fds"
        try:
            os.chdir(cwd)
            os.environ.clear()
            os.environ.update(env)
            sys.argv = [str(BIN / argv[0]), *argv[1:]]
            root.handlers.clear()
            root.setLevel(logging.WARNING)
            with (
                warnings.catch_warnings(),
                _fds_to(fd_text),
                contextlib.redirect_stdout(text),
                contextlib.redirect_stderr(text),
            ):
                warnings.resetwarnings()
                for action, category, module_re in reversed(_FRESH_FILTERS):
                    warnings.filterwarnings(action, category=category, module=module_re)
                warnings.showwarning = _show_on_stderr
                try:
                    entry()
                    code = 0
                except SystemExit as exc:
                    code = _exit_status(exc.code)
                except Exception:
                    traceback.print_exc()
                    code = 1
        finally:
            os.chdir(saved_cwd)
            os.environ.clear()
            os.environ.update(saved_env)
            sys.argv = saved_argv
            root.handlers[:] = saved_handlers
            root.setLevel(saved_level)
        return code, text.getvalue() + fd_text.read_text(errors="replace")


def _exit_status(code: object) -> int:
    """What ``sys.exit(code)`` leaves as the process's status (a message goes to stderr)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


class Session:
    """One document's working directory, environment and Python namespace."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        # (block line, command index) of lines that run in bash though they need not
        self.bash_first: set[tuple[int, int]] = set()
        (workdir / "examples").symlink_to(ROOT / "examples", target_is_directory=True)
        self.env = {k: v for k, v in os.environ.items() if k not in _TERMINAL_ENV}
        self.env["PATH"] = f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"
        self.env["COLUMNS"] = "140"
        self.namespace: dict[str, object] = {"__name__": "__docs__"}
        self.checker = doctest.OutputChecker()

    def run(self, block: Block) -> None:
        if block.lang == "console":
            self._console(block)
        elif block.lang == "pycon":
            self._pycon(block)
        elif block.lang == "python":
            self._python(block)

    def _console(self, block: Block) -> None:
        last: tuple[str, int] | None = None
        steps = parse_console(block.text)
        for k, (cmd, want) in enumerate(steps):
            if cmd.strip() == "echo $?":
                assert last is not None, f"{block.where}: `echo $?` before any command"
                assert last[1] == int(want), (
                    f"{block.where}: `{last[0]}` exited {last[1]}, the doc says {want.strip()}"
                )
                continue
            argv = None if (block.line, k) in self.bash_first else script_argv(cmd)
            if argv is None:
                returncode, got = self._bash(cmd)
            else:
                returncode, got = run_script(argv, self.env, self.workdir)
            if want and not self.checker.check_output(want, got, FLAGS):
                raise AssertionError(
                    f"{block.where}: output of `{cmd}` differs\n--- doc\n{want}--- actual\n{got}"
                )
            checked = k + 1 < len(steps) and steps[k + 1][0].strip() == "echo $?"
            if not checked:
                assert returncode == 0, (
                    f"{block.where}: `{cmd}` exited {returncode} (the doc expects 0; add "
                    f"`$ echo $?` to expect another code)\n{got}"
                )
            last = (cmd, returncode)

    def _bash(self, cmd: str) -> tuple[int, str]:
        proc = subprocess.run(
            cmd,
            shell=True,
            executable="/bin/bash",
            cwd=self.workdir,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=300,
        )
        return proc.returncode, proc.stdout

    def _pycon(self, block: Block) -> None:
        parser = doctest.DocTestParser()
        test = parser.get_doctest(block.text, self.namespace, block.where, block.doc, block.line)
        report: list[str] = []
        runner = doctest.DocTestRunner(optionflags=FLAGS)
        result = runner.run(test, out=report.append, clear_globs=False)
        self.namespace.update(test.globs)  # DocTest works on a copy of the namespace
        assert result.failed == 0, f"{block.where}: doctest failed\n" + "".join(report)

    def _python(self, block: Block) -> None:
        name = _file_block(block)
        if name is not None:
            (self.workdir / name).write_text(block.text.partition("\n")[2])
            return
        code = compile(block.text, block.where, "exec")
        exec(code, self.namespace)


# --- which blocks share state -------------------------------------------------------------
# Blocks of one document share a working directory and a namespace, so a block may need what
# an earlier one made. Each test item runs the blocks that are linked that way (transitively),
# in document order, in a fresh session; every other block runs alone. Links, found statically:
# - a Python name a block uses before binding it, bound by an earlier block (the latest one);
# - a path an earlier block creates (``# file: NAME``, ``--out``/``-o DIR``, ``> FILE``, a
#   file-like string literal in Python) whose first component a later block mentions.
# A missed link shows up as that item failing (a NameError, a missing file), with a note.

_BUILTINS = frozenset(dir(builtins))
# The characters a relative path in the docs is made of; a fragment after "+" is a transform
# (cpu+fp16), matched with its "+" so that it is no path.
_PATH = re.compile(r"\+?[\w.\-/]+")
_WRITE_OPTIONS = frozenset({"--out", "-o", ">", ">>"})


def _file_block(block: Block) -> str | None:
    """NAME for a python block whose first line is ``# file: NAME``."""
    if block.lang != "python":
        return None
    m = re.fullmatch(r"#\s*file:\s*(\S+)", block.text.partition("\n")[0].strip())
    return m[1] if m else None


def _code(block: Block) -> str:
    """What a block runs: a console block's commands, a pycon block's sources, python as is."""
    if block.lang == "console":
        return "\n".join(cmd for cmd, _ in parse_console(block.text))
    if block.lang == "pycon":
        return "".join(ex.source for ex in doctest.DocTestParser().get_examples(block.text))
    return block.text


def _heads(text: str) -> set[str]:
    """First components of the relative paths ``text`` may mention. ``examples/`` is in every
    session already; fragments starting with / or - are node names, absolute paths, options."""
    heads = set()
    for fragment in _PATH.findall(text):
        head = fragment.split("/", 1)[0]
        own = head not in {".", "..", "examples"}
        if head and not fragment.startswith(("/", "-", "+")) and own:
            heads.add(head)
    return heads


def _file_like(literal: str) -> set[str]:
    """Heads of the file names in a Python string literal: ``"images.npz"``, ``"case/x"``,
    ``"api-report"``; not plain words (``"cpu"``) or numbers (``"1e-3"``)."""
    heads = set()
    for fragment in _PATH.findall(literal):
        try:
            float(fragment)
            continue
        except ValueError:
            pass
        if re.search(r"[A-Za-z]", fragment) and re.search(r"[./-]", fragment):
            heads |= _heads(fragment)
    return heads


@dataclass(frozen=True)
class BlockState:
    defines: frozenset[str]  # Python names the block binds
    needs: frozenset[str]  # Python names it uses before binding them
    writes: frozenset[str]  # heads of the paths it creates in the working directory
    reads: frozenset[str]  # heads of the paths it mentions


def block_state(block: Block) -> BlockState:
    none: frozenset[str] = frozenset()
    name = _file_block(block)
    if name is not None:
        return BlockState(none, none, frozenset(_heads(name)), none)
    code = _code(block)
    reads = _heads(code)
    if block.lang == "console":
        writes: set[str] = set()
        for cmd, _ in parse_console(block.text):
            try:
                words = shlex.split(cmd)
            except ValueError:
                words = cmd.split()
            for flag, value in zip(words, words[1:], strict=False):
                if flag in _WRITE_OPTIONS:
                    writes |= _heads(value)
            for word in words:  # --out=DIR
                option, eq, value = word.partition("=")
                if eq and option in _WRITE_OPTIONS:
                    writes |= _heads(value)
        return BlockState(none, none, frozenset(writes), frozenset(reads))
    defined: set[str] = set()
    needs: set[str] = set()
    writes = set()
    try:
        statements = ast.parse(code).body
    except SyntaxError:  # the block fails when it runs, with the doctest's own message
        statements = []
    for stmt in statements:
        bound: set[str] = set()
        for node in ast.walk(stmt):
            if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
                bound.add(node.id)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                bound.add(node.name)
            elif isinstance(node, ast.arg):
                bound.add(node.arg)
            elif isinstance(node, ast.alias):
                bound.add((node.asname or node.name).split(".")[0])
            elif isinstance(node, ast.Import | ast.ImportFrom):
                modules = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    modules = [node.module]
                for module in modules:  # a module may be a file an earlier block wrote
                    top = module.split(".")[0]
                    reads |= {top, f"{top}.py"}
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                writes |= _file_like(node.value)
        loads = {
            n.id for n in ast.walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
        }
        needs |= loads - defined - bound - _BUILTINS
        defined |= bound
    return BlockState(frozenset(defined), frozenset(needs), frozenset(writes), frozenset(reads))


@dataclass(frozen=True)
class DocGroup:
    """Blocks of one document that run together, in order, in one fresh session."""

    doc: str
    blocks: tuple[Block, ...]
    needs: tuple[frozenset[int], ...]  # per block: positions in ``blocks`` it depends on

    @property
    def id(self) -> str:
        return f"{self.doc}:" + "+".join(str(b.line) for b in self.blocks)


def group_blocks(doc: str, blocks: list[Block]) -> list[DocGroup]:
    states = [block_state(b) for b in blocks]
    needs: list[set[int]] = [set() for _ in blocks]
    for i, state in enumerate(states):
        needs[i] |= {j for j in range(i) if state.reads & states[j].writes}
        for name in state.needs:
            definer = next((j for j in reversed(range(i)) if name in states[j].defines), None)
            if definer is not None:
                needs[i].add(definer)
    root = list(range(len(blocks)))

    def find(i: int) -> int:
        while root[i] != i:
            i = root[i]
        return i

    for i, deps in enumerate(needs):
        for j in deps:
            root[find(i)] = find(j)
    members: dict[int, list[int]] = {}
    for i in range(len(blocks)):
        members.setdefault(find(i), []).append(i)
    groups = []
    for idx in members.values():  # in document order of each group's first block
        pos = {i: k for k, i in enumerate(idx)}
        groups.append(
            DocGroup(
                doc,
                tuple(blocks[i] for i in idx),
                tuple(frozenset(pos[j] for j in needs[i]) for i in idx),
            )
        )
    return groups


def runnable_blocks(doc: str) -> list[Block]:
    return [b for b in parse_blocks(DOCS / doc) if b.lang in RUNNABLE]


DOC_GROUPS = [g for doc in RUN_DOCS for g in group_blocks(doc, runnable_blocks(doc))]
BASH_FIRST = {doc: _bash_first(doc) for doc in RUN_DOCS}
# The groups that take 8 s or more on two cores run in the slow lane (`make test-slow`), each
# found by its document and a phrase of its commands (line numbers move as the docs grow).
SLOW_GROUPS = {
    ("guide.md", "--dataset frames"): "a dataset of frames, each diagnosed",
    ("guide.md", "onnx-bisect repro pat/repro"): "a bundle made, re-run and re-targeted",
    ("report-format.md", "--quiet --out report"): "two diagnoses and every report file read",
    ("guide.md", "onnx-bisect sweep"): "four cases, each a diagnosis in a process of its own",
    ("guide.md", "--ref pytorch:tiny.py:make"): "torch imported, a TorchScript export, exec: runs",
    ("guide.md", "--quant-goal 'top1:logits@last>=100%'"): "two keep searches over 8 prompts",
}


def _slow(group: DocGroup) -> bool:
    return any(doc == group.doc and phrase in _code_of(group) for doc, phrase in SLOW_GROUPS)


def _code_of(group: DocGroup) -> str:
    return "\n".join(_code(b) for b in group.blocks)


def _param(group: DocGroup) -> Any:
    marks = [pytest.mark.slow] if _slow(group) else []
    return pytest.param(group, marks=marks, id=group.id)


@pytest.fixture
def session(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Session:
    if not (BIN / "bisect").exists() or not (BIN / "onnx-bisect").exists():
        pytest.skip(f"console scripts not installed next to {sys.executable}")
    s = Session(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    for key in ("PATH", "COLUMNS"):
        monkeypatch.setenv(key, s.env[key])
    return s


@pytest.mark.parametrize("group", [_param(g) for g in DOC_GROUPS])
def test_doc_examples_run(group: DocGroup, session: Session) -> None:
    session.bash_first = BASH_FIRST.get(group.doc, set())
    skipped: dict[int, str] = {}
    for k, block in enumerate(group.blocks):
        if block.requires is not None:
            assert block.requires in REQUIREMENTS, f"{block.where}: unknown requirement"
            if not REQUIREMENTS[block.requires]():
                skipped[k] = f"{block.where} requires {block.requires}, not available here"
                continue
        if group.needs[k] & skipped.keys():
            skipped[k] = f"{block.where} needs a skipped block"
            continue
        block_modules = set(sys.modules)
        try:
            session.run(block)
        except Exception as exc:
            exc.add_note(
                f"({group.id} ran in a fresh session: state from blocks outside this test "
                "item is missing; if the block needs some, group_blocks must link them)"
            )
            raise
        finally:
            # Modules a block wrote into the workdir must not leak into the next test item.
            for name in set(sys.modules) - block_modules:
                mod = sys.modules[name]
                if str(getattr(mod, "__file__", "") or "").startswith(str(session.workdir)):
                    del sys.modules[name]
    if skipped:
        pytest.skip("; ".join(skipped.values()))


def test_every_guide_doc_has_runnable_examples() -> None:
    for doc in RUN_DOCS:
        assert runnable_blocks(doc), f"docs/{doc} has no runnable examples"


def test_each_slow_group_is_found_once() -> None:
    for (doc, phrase), what in SLOW_GROUPS.items():
        found = [g.id for g in DOC_GROUPS if g.doc == doc and phrase in _code_of(g)]
        assert len(found) == 1, (
            f"SLOW_GROUPS: {phrase!r} ({what}) is in {len(found)} groups of docs/{doc} "
            f"{found}: name the slow one by a phrase of its own, or drop it"
        )


def test_doc_groups_run_every_block_once_in_document_order() -> None:
    for doc in RUN_DOCS:
        groups = [g for g in DOC_GROUPS if g.doc == doc]
        assert sorted(b.line for g in groups for b in g.blocks) == [
            b.line for b in runnable_blocks(doc)
        ]
        for g in groups:
            assert [b.line for b in g.blocks] == sorted(b.line for b in g.blocks)


def test_blocks_that_share_names_or_files_are_grouped(tmp_path: Path) -> None:
    fence = "```"
    doc = tmp_path / "doc.md"
    doc.write_text(
        f"{fence}console\n$ bisect m.onnx --target cpu --out=rep\n{fence}\n"  # 1: writes rep/
        f"{fence}pycon\n>>> x = [n for n in range(3)]\n{fence}\n"  # 2: binds x
        f"{fence}python\n# file: helper.py\ndef f(): return 1\n{fence}\n"  # 3: writes helper.py
        f"{fence}console\n$ ls rep\n{fence}\n"  # 4: reads rep/ -> 1
        f"{fence}pycon\n>>> from helper import f\n>>> f() + len(x)\n4\n{fence}\n"  # -> 3, 2
        f"{fence}python\nimport numpy as np\nnp.save('a.npy', np.zeros(1))\n{fence}\n"  # 6
        f"{fence}console\n$ bisect m.onnx --ref cpu --target 'cpu?opt=disable'\n{fence}\n"  # 7
        f"{fence}console\n$ python -c \"import numpy as np; np.load('a.npy')\"\n{fence}\n"  # -> 6
        f"{fence}pycon\n>>> import numpy as np\n>>> y = np.ones(2)\n{fence}\n"  # 9: own np
    )
    blocks = [b for b in parse_blocks(doc) if b.lang in RUNNABLE]
    order = {b.line: k + 1 for k, b in enumerate(blocks)}
    groups = group_blocks("doc.md", blocks)
    assert [[order[b.line] for b in g.blocks] for g in groups] == [
        [1, 4],
        [2, 3, 5],
        [6, 8],
        [7],
        [9],
    ]
    (shared,) = [g for g in groups if len(g.blocks) == 3]
    assert shared.needs == (frozenset(), frozenset(), frozenset({0, 1}))  # 5 needs 2 and 3


def test_a_block_whose_requirement_fails_is_a_skip_with_its_dependents(
    session: Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(REQUIREMENTS, "never", lambda: False)
    fence = "```"
    doc = session.workdir / "doc.md"
    doc.write_text(
        f"<!-- test: requires never -->\n{fence}console\n$ echo made > f.txt\n{fence}\n"
        f"{fence}console\n$ cat f.txt\nmade\n{fence}\n"  # needs f.txt: skipped too
    )
    (group,) = group_blocks("doc.md", [b for b in parse_blocks(doc) if b.lang in RUNNABLE])
    with pytest.raises(pytest.skip.Exception) as skip:
        test_doc_examples_run(group, session)
    assert str(skip.value) == (
        "docs/doc.md:2 requires never, not available here; docs/doc.md:5 needs a skipped block"
    )


def test_console_parser_reads_commands_outputs_and_exit_codes() -> None:
    text = "$ bisect a \\\n  --target b\nline 1\n...\n$ echo $?\n1\n$ ls\n"
    assert parse_console(text) == [
        ("bisect a  --target b", "line 1\n...\n"),
        ("echo $?", "1\n"),
        ("ls", ""),
    ]


def test_only_plain_lines_of_our_scripts_run_in_process() -> None:
    plain = {
        "bisect m.onnx --target cpu": ["bisect", "m.onnx", "--target", "cpu"],
        "onnx-bisect backends": ["onnx-bisect", "backends"],
        'bisect m.onnx --target "cpu?opt=disable" --out r': [
            "bisect", "m.onnx", "--target", "cpu?opt=disable", "--out", "r",
        ],
        "bisect m.onnx -t 'exec:python rt.py {model} {inputs} {outputs} --x=$1'": [
            "bisect", "m.onnx", "-t", "exec:python rt.py {model} {inputs} {outputs} --x=$1",
        ],
    }  # fmt: skip
    for cmd, argv in plain.items():
        assert script_argv(cmd) == argv, cmd
    shell = [
        "bisect m.onnx --target cpu | tail -n 2",
        "bisect m.onnx --target cpu > out.txt",
        "bisect m.onnx --target cpu && ls",
        "bisect m.onnx --target cpu; echo $?",
        "X=1 bisect m.onnx --target cpu",
        'bisect "$MODEL" --target cpu',
        "bisect m.onnx --target cpu?opt=disable",  # an unquoted glob
        "bisect *.onnx --target cpu",
        "bisect ~/m.onnx --target cpu",
        "bisect m.onnx --target cpu # a comment",
        "bisect m.onnx --target 'cpu",  # unbalanced: bash's own error
        "python -m onnx_bisect m.onnx",
        "echo bisect",
    ]
    for cmd in shell:
        assert script_argv(cmd) is None, cmd


@pytest.mark.parametrize(
    "cmd",
    [
        "bisect missing.onnx --target cpu --threshold 1e-3",
        "bisect examples/models/yolo_like.onnx --threshold 1e-3",  # typer's usage error
        "bisect --version",
        "onnx-bisect",
    ],
)
def test_a_line_run_in_process_is_what_bash_gives(cmd: str, session: Session) -> None:
    argv = script_argv(cmd)
    assert argv is not None
    assert run_script(argv, session.env, session.workdir) == session._bash(cmd)


def test_plain_lines_run_in_process_and_are_checked(
    session: Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    in_bash: list[str] = []
    bash = session._bash

    def recorded(cmd: str) -> tuple[int, str]:
        in_bash.append(cmd)
        return bash(cmd)

    monkeypatch.setattr(session, "_bash", recorded)
    fence, miss = "```", "bisect missing.onnx --target cpu --threshold 1e-3"
    error = "error: model file not found: missing.onnx"
    good = f"{fence}console\n$ {miss}\n{error}...\n$ echo $?\n2\n$ {miss} | cat\n{error}...\n"
    (block,) = parse_blocks(_doc(session.workdir, good + f"$ echo $?\n0\n{fence}\n"))
    session.run(block)
    assert in_bash == [f"{miss} | cat"]
    (block,) = parse_blocks(_doc(session.workdir, f"{fence}console\n$ {miss}\n{fence}\n"))
    with pytest.raises(AssertionError, match="exited 2 "):
        session.run(block)
    wrong = f"{fence}console\n$ {miss}\nerror: all is well\n$ echo $?\n2\n{fence}\n"
    (block,) = parse_blocks(_doc(session.workdir, wrong))
    with pytest.raises(AssertionError, match="differs"):
        session.run(block)
    assert in_bash == [f"{miss} | cat"]


def _doc(workdir: Path, text: str) -> Path:
    path = workdir / "doc.md"
    path.write_text(text)
    return path


def test_docs_use_only_known_fences() -> None:
    allowed = {"console", "pycon", "python", "text", "shell", "toml", "json", "markdown", "csv"}
    for doc in GUIDE_DOCS:
        for block in parse_blocks(DOCS / doc):
            assert block.lang in allowed, f"{block.where}: fence language {block.lang!r}"


class _PlantedFault(onnx_bisect.BackendBase):
    """In-process twin of ``examples/faulty_runtime.py --fault NODE=0.05`` (no subprocesses)."""

    def __init__(self, node: str) -> None:
        super().__init__(onnx_bisect.parse_spec("planted"))
        spec = importlib.util.spec_from_file_location("faulty_runtime", FAULTY_RUNTIME)
        assert spec is not None and spec.loader is not None
        self.runtime = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(self.runtime)
        self.node, self.cpu = node, onnx_bisect.create_backend("cpu")

    def _run(self, model: Any, feeds: Any) -> dict[str, Any]:
        return self.cpu.run(self.runtime.plant_fault(model, self.node, 0.05), feeds)


def test_report_format_doc_names_every_field(tmp_path: Path) -> None:
    """Every key of a real report.json and every nodes.csv column is described in the doc."""
    result = onnx_bisect.bisect(YOLO, ref="cpu", target=_PlantedFault("/down1/conv/Conv"))
    out = tmp_path / "report"
    onnx_bisect.write_reports(result, out)
    report = json.loads((out / "report.json").read_text())
    node = report["nodes"][0]
    keys = set(report) | set(report["first_divergence"]) | set(report["root_cause"])
    keys |= set(node) | set(node["accumulated"]) | set(node["accumulated"]["metrics"])
    keys |= set(report["outputs"][0]) | {"tensor", "node", "reason"}  # not_probed entries
    columns = (out / "nodes.csv").read_text().splitlines()[0].split(",")
    doc = (DOCS / "report-format.md").read_text()
    named = set(re.findall(r"`([A-Za-z_]\w*)`", doc))
    assert not sorted(keys - named), f"report.json fields not in the doc: {sorted(keys - named)}"
    assert not sorted(set(columns) - named), f"nodes.csv columns not in the doc: {columns}"
    assert report["schema"] == "onnx-bisect/report/v1" and report["schema"] in doc
    assert report["root_cause"] == {
        "kind": "culprit",
        "nodes": ["/down1/conv/Conv"],
        "reason": report["root_cause"]["reason"],
        "message": "",  # the runtime's own words, for failures only
        "workaround": None,  # a precision the runtime chose: its fp32 spec
        "workaround_verified": False,  # that spec agrees on the whole model
        "model_message": "",  # the full model's own words, where a prefix said other
        "fails_at": None,  # where the target gives up, when not the node named
        # A TorchScript-style scoped name gives the module path alone.
        "source": {"module": "down1.conv", "class": None, "file": None, "line": None,
                   "code": None},
    }
    documented = set(re.findall(r"^\| `([a-z-]+)` \|", doc, re.M))
    assert {v.value for v in Verdict} <= documented, "a verdict is missing from the table"


def test_plugin_from_adapters_doc_registers_through_entry_points(tmp_path: Path) -> None:
    """The adapter module and the pyproject entry point shown in adapters.md work as a plugin."""
    blocks = parse_blocks(DOCS / "adapters.md")
    module = next(b for b in blocks if b.lang == "python" and b.text.startswith("# file:"))
    name = module.text.split("\n", 1)[0].split(":", 1)[1].strip()
    (tmp_path / name).write_text(module.text.split("\n", 1)[1])
    pyproject = next(b for b in blocks if b.lang == "toml")
    eps = tomllib.loads(pyproject.text)["project"]["entry-points"]["onnx_bisect.adapters"]
    dist = tmp_path / "my_runtime_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: my-runtime-plugin\nVersion: 0.1\n")
    lines = "".join(f"{k} = {v}\n" for k, v in eps.items())
    (dist / "entry_points.txt").write_text(f"[onnx_bisect.adapters]\n{lines}")
    env = dict(os.environ, PYTHONPATH=str(tmp_path), COLUMNS="200")
    listing = subprocess.run(
        [str(BIN / "onnx-bisect"), "backends"], env=env, capture_output=True, text=True
    )
    assert listing.returncode == 0, listing.stderr
    for plugin in eps:
        row = next(ln for ln in listing.stdout.splitlines() if f" {plugin} " in ln)
        assert "yes" in row, row
    plugin = next(iter(eps))
    run = subprocess.run(
        [str(BIN / "bisect"), "examples/models/yolo_like.onnx", "--target", plugin],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "No divergence" in run.stdout


def test_docs_cover_every_cli_option_backend_and_alias() -> None:
    guide = (DOCS / "guide.md").read_text()
    command = typer.main.get_command(bisect_app)
    for param in command.params:
        longest = max(param.opts, key=len)
        if longest.startswith("--") and longest != "--help":
            assert longest in guide, f"guide.md never mentions {longest}"
    backends = (DOCS / "backends.md").read_text()
    for name in (*adapters(), *ALIASES):
        assert f"`{name}`" in backends, f"backends.md never mentions `{name}`"
    for device in PROVIDERS:
        assert f"| `{device}`" in backends, f"backends.md: no row for ort device {device}"
    for code in (EXIT_MATCH, EXIT_DIVERGED, EXIT_USAGE, EXIT_INTERNAL):
        assert re.search(rf"^\| {code} \|", guide, re.M), f"guide.md: no row for exit {code}"


def test_readme_links_every_doc() -> None:
    readme = (ROOT / "README.md").read_text()
    for doc in GUIDE_DOCS:
        assert f"docs/{doc}" in readme
