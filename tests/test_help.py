"""``--help`` read as a newcomer reads it: in a terminal 80 columns wide, options in panels,
nothing cut, short enough to read, with examples."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

from onnx_bisect.cli.params import PANELS

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[1]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def in_terminal(*argv: str, columns: int = 80) -> tuple[int, str]:
    """A console script run with stdout and stderr a terminal ``columns`` wide (as the kernel
    says; COLUMNS unset): its exit code and what it printed, escape codes removed."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "NO_COLOR")}
    env |= {"TERM": "xterm-256color", "PYTHONPATH": str(ROOT)}
    parent, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    proc = subprocess.Popen(
        [str(BIN / argv[0]), *argv[1:]],
        stdin=subprocess.DEVNULL,
        stdout=child,
        stderr=child,
        cwd=ROOT,
        env=env,
    )
    os.close(child)
    chunks = []
    while True:
        try:
            data = os.read(parent, 65536)
        except OSError:  # EIO: the other end is closed
            break
        if not data:
            break
        chunks.append(data)
    code = proc.wait(timeout=120)
    os.close(parent)
    return code, ANSI.sub("", b"".join(chunks).decode()).replace("\r\n", "\n")


@pytest.mark.parametrize("argv", [("bisect", "--help"), ("onnx-bisect", "--help")])
def test_help_fits_80_columns_whole_and_short(argv: tuple[str, ...]) -> None:
    code, text = in_terminal(*argv)
    assert code == 0, text
    lines = text.rstrip("\n").splitlines()
    assert "…" not in text, text  # no option name or value cut
    assert max(len(line) for line in lines) <= 80, text
    assert len(lines) < 120, f"{len(lines)} lines:\n{text}"


def test_bisect_help_groups_options_in_panels_with_examples() -> None:
    _, text = in_terminal("bisect", "--help")
    lines = text.splitlines()
    assert lines[0] == "Usage: bisect MODEL --target SPEC [OPTIONS]"
    titles = [m[1] for line in lines if (m := re.match(r"╭─ (.+?) ─", line))]
    assert titles == list(PANELS)
    # --x/--no-x as one label; an option wider than its column keeps a line of its own.
    assert any(re.match(r"│ --repro/--no-repro +With --out: write", line) for line in lines)
    assert "│ --isolate-crashes/--no-isolate-crashes" in text
    assert "│ --target-precision float16|bfloat16|tf32|float32 " in text
    # --target shows specs to copy and where the rest are.
    target = text[text.index("-t, --target SPEC") : text.index("-r, --ref SPEC")]
    flat = " ".join(re.sub(r"[│]", " ", target).split())
    assert "'openvino?precision=f32'" in flat and "'torch:cpu?dtype=bfloat16'" in flat
    assert "`onnx-bisect backends` lists those that work here" in flat
    # Three examples, each on one line, then the exit codes.
    examples = lines[lines.index("Examples:") + 1 :][:3]
    assert [e.split()[:2] for e in examples] == [["bisect", "model.onnx"]] * 3
    assert "exec:{python} my_rt.py {model} {inputs} {outputs}" in examples[2]
    assert "Exit codes: 0 no divergence, 1 divergence found" in text


def test_commands_sharing_an_option_show_it_in_the_same_panel() -> None:
    _, text = in_terminal("onnx-bisect", "reduce", "--help")
    judgement = text[text.index("╭─ Judgement") :]
    assert "--metric NAME" in judgement.split("╰")[0]
