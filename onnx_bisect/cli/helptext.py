"""``--help`` as two columns in panels: the option as typed (``-t, --target SPEC``,
``--repro/--no-repro``) and what it does, wrapped, never cut.

typer's own layout gives each option five columns (long name, short name, negative long
name, negative short name, type) beside the help: at 80 columns the help column was 16
characters wide and the names and values were cut with "…". Here the option's words are one
column; one wider than that column gets a line of its own, the help starting below it. The
panels are the options' ``rich_help_panel``, declared once in ``cli/params.py``, so every
command that shares an option shows it in the same panel.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Iterable, Sequence
from typing import Any

from rich.console import Console
from rich.panel import Panel
from rich.text import Text

__all__ = ["LABEL_WIDTH", "print_command_help", "print_group_help"]

# Commands, contexts and parameters are typed Any: typer derives its classes from click's or
# from a vendored copy of click, depending on its release.
LABEL_WIDTH = 26  # the option column; a longer label takes a line of its own
_MAX_WIDTH = 100  # wider help is harder to read, not shorter
_DEFAULT_PANEL = "Options"
_LABEL_STYLE = "bold cyan"


def _console() -> Console:
    console = Console(highlight=False)
    return Console(highlight=False, width=min(console.width, _MAX_WIDTH))


def _plain(text: str | None) -> str:
    """Help as written for rich markup (``\\[`` for a bracket), as plain text."""
    return Text.from_markup(text or "").plain if text else ""


def _is_argument(param: Any) -> bool:
    # By the parameter's own word: typer's classes derive from click's or from its vendored copy.
    return getattr(param, "param_type_name", "") == "argument"


def _label(param: Any) -> str:
    if _is_argument(param):
        return param.metavar or (param.name or "").upper()
    names = sorted(param.opts, key=lambda o: (o.startswith("--"), o))
    words = ", ".join(names)
    if param.secondary_opts:
        words = "/".join([words, *param.secondary_opts])
    metavar = param.metavar or ""
    return f"{words} {metavar}".rstrip() if metavar else words


def _default(param: Any) -> str:
    if _is_argument(param) or getattr(param, "show_default", None) is False:
        return ""
    value = param.default
    if value is None or value is False or value == "" or value == () or callable(value):
        return ""
    if value is True:
        return f"[default: {param.opts[-1] if not param.secondary_opts else param.opts[0]}]"
    shown = ",".join(map(str, value)) if isinstance(value, list | tuple) else str(value)
    return f"[default: {shown}]"


def _help(param: Any) -> str:
    words = [_plain(getattr(param, "help", None))]
    if param.required:
        words.append("[required]")
    words.append(_default(param))
    return " ".join(w for w in words if w)


_NBSP = "\u00a0"
# Words a line must not break: a default, a quoted example (a spec), when they fit a line.
_UNBROKEN = re.compile(r"\[default: [^\]]*\]|'[^']*'")


def _wrap(text: str, width: int) -> list[str]:
    def glue(m: re.Match[str]) -> str:
        # Room for the punctuation that follows it, which textwrap counts as the same word.
        return m[0].replace(" ", _NBSP) if len(m[0]) < width - 2 else m[0]

    lines = textwrap.wrap(_UNBROKEN.sub(glue, text), width, break_on_hyphens=False)
    return [line.replace(_NBSP, " ") for line in lines] or [""]


def _rows(rows: Iterable[tuple[str, str]], width: int) -> Text:
    """Each (label, help) as lines of ``width``: the help beside its label, or below it."""
    text = Text()
    wrap = max(width - LABEL_WIDTH - 2, 20)
    indent = " " * (LABEL_WIDTH + 2)
    for label, help_text in rows:
        lines = _wrap(help_text, wrap)
        if len(label) <= LABEL_WIDTH:
            text.append(label.ljust(LABEL_WIDTH + 2), style=_LABEL_STYLE)
            text.append(lines[0] + "\n")
            rest = lines[1:]
        else:
            text.append(label + "\n", style=_LABEL_STYLE)
            rest = lines
        for line in rest:
            text.append(indent + line + "\n")
    text.rstrip()
    return text


def _panels(params: Sequence[Any], order: Sequence[str]) -> list[tuple[str, list[Any]]]:
    grouped: dict[str, list[Any]] = {}
    for param in params:
        if getattr(param, "hidden", False):
            continue
        panel = getattr(param, "rich_help_panel", None) or _DEFAULT_PANEL
        grouped.setdefault(panel, []).append(param)
    known = [p for p in order if p in grouped]
    return [(p, grouped[p]) for p in [*known, *(p for p in grouped if p not in known)]]


def _panel(title: str, body: Text) -> Panel:
    return Panel(body, title=title, title_align="left", border_style="dim", padding=(0, 1))


def _head(console: Console, usage: str, text: str | None) -> None:
    console.print(Text("Usage: ", style="bold yellow") + Text(usage, style="bold"))
    if text:
        console.print()
        for para in (text or "").strip().split("\n\n"):
            console.print(Text(" ".join(para.split())))
    console.print()


def _epilog(console: Console, epilog: str | None) -> None:
    if not epilog:
        return
    # Examples keep their lines: a command is not a paragraph to refill.
    console.print()
    console.print(Text(_plain(epilog).strip("\n")), soft_wrap=False, overflow="fold")


def print_command_help(command: Any, ctx: Any, panel_order: Sequence[str]) -> None:
    console = _console()
    # The arguments first, then the required options, as a command is typed.
    params = command.get_params(ctx)
    words = [_label(p) for p in params if _is_argument(p)]
    words += [_label(p).split(", ")[-1] for p in params if p.required and not _is_argument(p)]
    _head(console, " ".join([ctx.command_path, *words, "[OPTIONS]"]), command.help)
    inner = console.width - 4  # the panel's border and padding
    for title, members in _panels(params, panel_order):
        rows = ((_label(p), _help(p)) for p in members)
        console.print(_panel(title, _rows(rows, inner)))
    _epilog(console, command.epilog)


def print_group_help(group: Any, ctx: Any) -> None:
    console = _console()
    _head(console, f"{ctx.command_path} [OPTIONS] COMMAND [ARGS]...", group.help)
    inner = console.width - 4
    names = group.list_commands(ctx)
    commands: list[Any] = [group.get_command(ctx, n) for n in names]
    rows = (
        (n, _plain(c.get_short_help_str(limit=200)))
        for n, c in zip(names, commands, strict=True)
        if c is not None and not c.hidden
    )
    console.print(_panel("Commands", _rows(rows, inner)))
    # A group's own options are few (--version, --help): one panel.
    options = [p for p in group.get_params(ctx) if not getattr(p, "hidden", False)]
    console.print(_panel(_DEFAULT_PANEL, _rows(((_label(p), _help(p)) for p in options), inner)))
    _epilog(console, group.epilog)
