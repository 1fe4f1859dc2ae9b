"""What a run leaves on disk while it lives, and the sweep of what a killed run left.

A run's folders (the command's temporary folder, a staging folder beside ``--out``) are held
with an exclusive ``flock`` on the folder itself for as long as the run lives. The kernel
drops the lock when the process dies, however it dies (SIGKILL included), so a later run can
tell a dead run's leftovers from a live concurrent run's without trusting a pid, which may be
reused or belong to another container sharing the folder: a folder it can lock is nobody's,
and is removed. A folder is created under a name the sweep ignores (``.new`` at the end),
locked, then renamed, so that no sweep can take it between its creation and its lock.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["RUN_PREFIX", "held_dir", "run_temp_dir", "sweep"]

log = logging.getLogger(__name__)

try:
    import fcntl
except ImportError:  # Windows: no flock, so no sweep; a run's own cleanup still runs
    fcntl = None  # type: ignore[assignment]

# A command's temporary folder in the system's: ``onnx-bisect-run-<pid>-XXXXXX``.
RUN_PREFIX = "onnx-bisect-run-"
_NEW = ".new"


@contextmanager
def held_dir(parent: Path, prefix: str) -> Iterator[Path]:
    """A fresh folder ``parent/<prefix><pid>-XXXXXX``, locked while the block runs, and
    removed with everything in it when it ends (an error, a signal turned into an
    exception). ``sweep(parent, prefix)`` removes it if the process is killed instead."""
    pending = Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", suffix=_NEW, dir=parent))
    fd = os.open(pending, os.O_RDONLY)
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)  # our own fresh folder: nobody else holds it
        path = pending.with_name(pending.name.removesuffix(_NEW))
        os.rename(pending, path)
        try:
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)
    finally:
        os.close(fd)
        shutil.rmtree(pending, ignore_errors=True)  # when the rename itself failed


def sweep(parent: Path, prefix: str) -> list[Path]:
    """Remove the folders ``parent/<prefix>*`` whose run is gone (nobody holds their lock);
    return them. Those of live runs, and anything that is not a folder, are left alone."""
    removed: list[Path] = []
    if fcntl is None:
        return removed
    try:
        entries = list(Path(parent).iterdir())
    except OSError:
        return removed
    for entry in entries:
        name = entry.name
        if not name.startswith(prefix) or name.endswith(_NEW) or entry.is_symlink():
            continue
        if entry.is_dir() and _remove_if_unheld(entry):
            removed.append(entry)
    if removed:
        log.info("removed %d folder(s) of killed runs in %s", len(removed), parent)
    return removed


def _remove_if_unheld(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False  # a live run's
    try:
        shutil.rmtree(path, ignore_errors=True)
    finally:
        os.close(fd)
    return not path.exists()


@contextmanager
def run_temp_dir() -> Iterator[Path]:
    """The command's own temporary folder, inside the system's, for the whole command: every
    temporary folder of this process and of its children (``TMPDIR``) goes in it, so one
    removal on the way out leaves nothing, and one sweep after a killed run finds it all.
    Leftovers of killed runs are swept first."""
    system = Path(tempfile.gettempdir())
    sweep(system, RUN_PREFIX)
    saved_env, saved_dir = os.environ.get("TMPDIR"), tempfile.tempdir
    with held_dir(system, RUN_PREFIX) as root:
        _set_temp(str(root), str(root))
        try:
            yield root
        finally:
            _set_temp(saved_env, saved_dir)


def _set_temp(env: str | None, directory: str | None) -> None:
    if env is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = env
    tempfile.tempdir = directory
