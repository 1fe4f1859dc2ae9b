"""Text from a model, a user or a runtime (node and tensor names, paths, specs) placed in
Markdown and in the shell commands the reports show, so that no such text can break them.

A node name is any string: ONNX allows a newline, a backtick or a ``|`` in it, and a newline
in a table row ends the row, a backtick ends a code span and a ``|`` starts a new cell. The
name is shown as it is, with control characters written as escapes (``\\n``), inside a code
span whose fence is longer than any run of backticks in it.
"""

from __future__ import annotations

import shlex
from os import PathLike

__all__ = ["cell", "code", "one_line", "shell"]

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
_CONTROL = {
    c: _NAMED.get(chr(c), f"\\x{c:02x}") for c in (*range(0x20), 0x7F, 0x85, 0x2028, 0x2029)
}


def one_line(text: str) -> str:
    """``text`` on one line: control characters and line separators as escapes."""
    return str(text).translate(_CONTROL)


def code(text: str | PathLike[str]) -> str:
    """An inline Markdown code span showing ``text`` on one line, whatever backticks it holds
    (CommonMark: a fence longer than any backtick run inside, padded with a space so that a
    backtick at either end is not part of the fence)."""
    body = one_line(str(text)) or " "
    longest = _longest_run(body)
    fence = "`" * (longest + 1)
    pad = " " if longest or (body.startswith(" ") and body.endswith(" ") and body.strip()) else ""
    return f"{fence}{pad}{body}{pad}{fence}"


def cell(text: str) -> str:
    """A Markdown table cell: one line, its ``|`` escaped (GitHub splits cells on ``|`` even
    inside a code span, and shows ``\\|`` there as ``|``)."""
    return one_line(text).replace("|", "\\|")


def shell(text: str | PathLike[str]) -> str:
    """One word of a POSIX shell command, quoted where it needs to be."""
    return shlex.quote(str(text))


def _longest_run(text: str) -> int:
    longest = run = 0
    for c in text:
        run = run + 1 if c == "`" else 0
        longest = max(longest, run)
    return longest
