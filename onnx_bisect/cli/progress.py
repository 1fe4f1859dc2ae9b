"""What the CLI shows while a diagnosis runs, on stderr: a live line on a terminal, log lines.

The live line (phase, runs so far, elapsed time) is for a person watching a long run; a pipe or
a file gets nothing, as the line would be noise there. Log lines (``--verbose``) go through the
same console, so that they print above the live line instead of through it.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from threading import Lock

from rich.console import Console
from rich.progress import Progress as RichProgress
from rich.progress import SpinnerColumn, TextColumn, TimeElapsedColumn

from onnx_bisect.cli.output import err
from onnx_bisect.engine.progress import Progress
from onnx_bisect.text import runs_text

__all__ = ["LiveLine", "configure_logging", "live_progress"]

LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"


class LiveLine:
    """``⠋ scan: ref 1 run, target 1 run  0:00:04``: the phases under way (the float64
    oracle's runs beside the screen), the runs each has done, the time since the start."""

    def __init__(self, console: Console) -> None:
        self.display = RichProgress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            TimeElapsedColumn(),
            console=console,
            transient=True,  # gone once the summary is due: it was a view of the work, not a result
        )
        self._task = self.display.add_task("starting", total=None)
        self._open: dict[str, Mapping[str, int]] = {}
        self._lock = Lock()

    def phase_started(self, phase: str) -> None:
        with self._lock:
            self._open[phase] = {}
            self._show()

    def run_done(self, phase: str, runs: Mapping[str, int]) -> None:
        with self._lock:
            if phase in self._open:
                self._open[phase] = runs
            self._show()

    def phase_done(self, phase: str, seconds: float, runs: Mapping[str, int]) -> None:
        with self._lock:
            self._open.pop(phase, None)
            self._show()

    def _show(self) -> None:
        shown = [f"{p}: {runs_text(r)}" if r else p for p, r in self._open.items()]
        # Drawn now, not at the next tick: a phase can be shorter than a tick.
        self.display.update(self._task, description="; ".join(shown) or "…", refresh=True)


@contextmanager
def live_progress(*, quiet: bool) -> Iterator[Progress | None]:
    """A ``LiveLine`` on stderr while the block runs, when stderr is a terminal and the user
    did not ask for quiet; else None (the engine's default: nobody watching)."""
    if quiet or not sys.stderr.isatty():
        yield None
        return
    line = LiveLine(err)
    with line.display:
        yield line


class _ConsoleHandler(logging.Handler):
    """Log records through a rich console: whole lines, no markup, above any live line."""

    def __init__(self, console: Console) -> None:
        super().__init__()
        self.console = console

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record)
            self.console.print(text, markup=False, highlight=False, emoji=False, soft_wrap=True)
        except Exception:
            self.handleError(record)


def configure_logging(*, verbose: bool, debug: bool) -> None:
    """``--verbose``: the phases with their times and runs, and the engine's decisions;
    ``--debug``: every internal step too."""
    handler = _ConsoleHandler(err)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    level = logging.DEBUG if debug else logging.INFO if verbose else logging.WARNING
    logging.basicConfig(level=level, handlers=[handler])
