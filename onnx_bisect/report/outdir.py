"""An output directory written as a set: checked before any work, staged beside itself, and
swapped in at the end.

A command writes everything into a fresh staging directory next to ``--out``; when it is done,
the files the tool owns in ``--out`` (those it may write there) are moved out and the new ones
moved in, so a reused directory never mixes two runs' files, and an interruption leaves either
the old set or the new one, never half of one. Files the tool does not own are left alone.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from onnx_bisect.errors import InputError

__all__ = [
    "STAGE_PREFIX",
    "Replaced",
    "check_out_dir",
    "is_stage_name",
    "replace_owned",
    "staging_dir",
]

# Staging directories are hidden siblings: ``.NAME.onnx-bisect-XXXXXX``.
STAGE_PREFIX = ".onnx-bisect-"


@dataclass(frozen=True)
class Replaced:
    """What ``replace_owned`` did to ``path``: the entries it wrote, the earlier ones of the
    tool's it removed, and those it left alone because the tool did not write them."""

    path: Path
    written: tuple[str, ...]
    removed: tuple[str, ...]
    kept: tuple[str, ...]


def check_out_dir(path: Path, option: str = "--out") -> None:
    """Raise ``InputError`` unless ``path`` is a directory, or can be made one, that we can
    write in: a file there, a file on the way to it, or no permission would otherwise surface
    only after the whole diagnosis."""
    path = Path(path)
    if path.is_symlink() and not path.exists():
        raise InputError(f"{option} {path}: a broken symbolic link; remove it or choose another")
    if path.exists() and not path.is_dir():
        raise InputError(
            f"{option} {path}: is a file, not a directory; choose a directory (it is created "
            "if missing)"
        )
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise InputError(
            f"{option} {path}: {existing} is a file, so no directory can be made under it; "
            "choose another directory"
        )
    # Where the staging directory goes (beside ``path``, see ``_stage_base``) and ``path``
    # itself must take new entries: try it, as permissions alone do not tell (root, read-only
    # mounts).
    places = [existing] if existing != path else [_stage_base(path), path]
    for place in dict.fromkeys(places):
        try:
            Path(tempfile.mkdtemp(prefix=STAGE_PREFIX, dir=place)).rmdir()
        except OSError as exc:
            reason = exc.strerror or type(exc).__name__
            raise InputError(
                f"{option} {path}: cannot write in {place} ({reason}); choose a directory "
                "you can write to"
            ) from None


@contextmanager
def staging_dir(out: Path) -> Iterator[Path]:
    """A fresh directory to write ``out``'s new files into, removed on the way out whatever
    happens (an error, Ctrl-C): whatever was not moved into ``out`` by then is dropped."""
    out = Path(out).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{out.name}{STAGE_PREFIX}", dir=_stage_base(out)))
    try:
        yield stage
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def replace_owned(stage: Path, out: Path, owned: Collection[str]) -> Replaced:
    """Move every entry of ``stage`` into ``out``, after moving out the entries of ``out`` that
    are named in ``owned`` (what the tool may write there) and are not rewritten now.

    The renames run with Ctrl-C held back until they are done: they take microseconds, and
    stopping halfway would leave two runs' files mixed.
    """
    shown = Path(out)
    stage, out = Path(stage).absolute(), Path(out).absolute()
    new = sorted(p.name for p in stage.iterdir())
    out.mkdir(parents=True, exist_ok=True)
    ours = set(owned) | set(new)
    present = sorted(p.name for p in out.iterdir() if not is_stage_name(p.name))
    old = [n for n in present if n in ours]
    with _interrupts_held():
        trash = Path(tempfile.mkdtemp(prefix=".old-", dir=stage))
        for name in old:
            os.replace(out / name, trash / name)
        for name in new:
            os.replace(stage / name, out / name)
    # The stage (and the old entries in it) go when ``staging_dir`` ends.
    removed = tuple(n for n in old if n not in new)
    kept = tuple(n for n in present if n not in ours)
    return Replaced(shown, tuple(new), removed, kept)


def _stage_base(out: Path) -> Path:
    """Beside ``out``, so that the final renames stay on one file system; inside ``out`` when
    its parent is not writable (``--out .`` in a home directory, say)."""
    parent = out.absolute().parent
    if os.access(parent, os.W_OK | os.X_OK) or not out.is_dir():
        return parent
    return out


def is_stage_name(name: str) -> bool:
    """A staging directory's name: inside ``out`` (this run's, or a killed run's), it is not
    one of ``out``'s entries."""
    return name.startswith(".") and STAGE_PREFIX in name


@contextmanager
def _interrupts_held() -> Iterator[None]:
    """SIGINT is remembered, not acted on, until the block ends (main thread only: signal
    handlers cannot be set elsewhere, and Python delivers SIGINT to the main thread anyway)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []

    def remember(signum: int, frame: FrameType | None) -> None:
        caught.append(signum)

    previous = signal.signal(signal.SIGINT, remember)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)
        if caught:
            raise KeyboardInterrupt
