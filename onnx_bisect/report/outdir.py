"""An output directory written as a set: checked before any work, staged beside itself, and
swapped in at the end.

A command writes everything into a fresh staging directory next to ``--out``; when it is done,
the files the tool owns in ``--out`` (those it may write there) are moved out and the new ones
moved in, so a reused directory never mixes two runs' files, and an interruption leaves either
the old set or the new one, never half of one. Files the tool does not own are left alone.
"""

from __future__ import annotations

import os
import signal
import tempfile
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from onnx_bisect.errors import InputError
from onnx_bisect.leftovers import held_dir, sweep
from onnx_bisect.process import signal_handlers
from onnx_bisect.report.manifest import MANIFEST, check_owned, manifest_text

__all__ = [
    "STAGE_PREFIX",
    "Replaced",
    "check_out_dir",
    "is_stage_name",
    "replace_owned",
    "staging_dir",
    "swap_in",
]

# Staging directories are hidden siblings: ``.NAME.onnx-bisect-XXXXXX``.
STAGE_PREFIX = ".onnx-bisect-"
# Directories that are never a tool's own: the file system's root and the top-level system
# directories (``$HOME`` is added at the check, as it depends on the user).
SHARED_DIRS = (
    "/", "/bin", "/boot", "/dev", "/etc", "/lib", "/lib64", "/proc", "/sbin", "/sys", "/usr",
    "/var",
)  # fmt: skip


@dataclass(frozen=True)
class Replaced:
    """What ``replace_owned`` did to ``path``: the entries it wrote, the earlier ones of the
    tool's it removed, and those it left alone because the tool did not write them."""

    path: Path
    written: tuple[str, ...]
    removed: tuple[str, ...]
    kept: tuple[str, ...]


def check_out_dir(
    path: Path,
    option: str = "--out",
    *,
    owned: Collection[str] = (),
    reads: Sequence[Path] = (),
) -> None:
    """Raise ``InputError`` unless ``path`` is a directory, or can be made one, that we can
    write in: a file there, a file on the way to it, or no permission would otherwise surface
    only after the whole diagnosis. It must also be a directory the tool may treat as its own:
    not ``/``, ``$HOME`` or a system directory, not the one holding a file the run reads
    (``reads``, the model), and no name in ``owned`` (what the tool may write there) taken by
    an entry the tool did not write (``manifest.check_owned``)."""
    path = Path(path)
    if path.is_symlink() and not path.exists():
        raise InputError(f"{option} {path}: a broken symbolic link; remove it or choose another")
    _refuse_shared(path, option)
    _refuse_read_files(path, option, owned, reads)
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
    check_owned(path.resolve(), owned, option)


def _refuse_shared(path: Path, option: str) -> None:
    """``/``, ``$HOME`` and the system directories hold what is not ours to replace (as root,
    ``--out /`` would write the reports into ``/``)."""
    real = path.resolve()
    home = Path(os.path.expanduser("~"))
    if real in {home, home.resolve()}:
        what = "your home directory"
    elif real in {q for d in SHARED_DIRS for q in (Path(d), Path(d).resolve())}:
        what = "the root directory" if real == Path("/") else "a system directory"
    else:
        return
    raise InputError(
        f"{option} {path}: is {what} ({real}); onnx-bisect replaces its own files in --out, so "
        "give it a directory of its own (a new one, e.g. report)"
    )


def _refuse_read_files(
    path: Path, option: str, owned: Collection[str], reads: Sequence[Path]
) -> None:
    """The directory holding the model is the user's; and a model inside an entry the run
    replaces (``report/repro/model.onnx``) would be gone after the run."""
    real = path.resolve()
    for read in reads:
        file = Path(read).resolve()
        inside = [n for n in owned if file.is_relative_to(real / n)]
        if file.parent == real or inside:
            where = f"{path}/{inside[0]}, which this run replaces" if inside else str(path)
            raise InputError(
                f"{option} {path}: {read} is in {where}; choose another directory for the "
                "output (a new one, e.g. report)"
            )


@contextmanager
def staging_dir(out: Path) -> Iterator[Path]:
    """A fresh directory to write ``out``'s new files into, removed on the way out whatever
    happens (an error, Ctrl-C, SIGTERM): whatever was not moved into ``out`` by then is
    dropped. Held by this process while it lives (``leftovers.held_dir``), so that the
    staging directories of killed runs (SIGKILL) beside ``out`` are swept here first, and a
    live concurrent run's are not."""
    out = Path(out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{out.name}{STAGE_PREFIX}"
    base = _stage_base(out)
    sweep(base, prefix)
    with held_dir(base, prefix) as stage:
        yield stage


def replace_owned(stage: Path, out: Path, owned: Collection[str]) -> Replaced:
    """Move every entry of ``stage`` into ``out``, after moving out the entries of ``out`` that
    the tool wrote earlier (its manifest lists them) and that are not rewritten now; a new
    manifest lists what is written. An entry to be written whose name is taken by one the tool
    did not write is refused (checked before the run too, by ``check_out_dir``; again here, as
    the directory may have changed while the tool ran)."""
    shown = Path(out)
    stage, out = Path(stage).absolute(), Path(out).resolve()
    new = sorted(p.name for p in stage.iterdir())
    earlier = check_owned(out, {*owned, *new})
    (stage / MANIFEST).write_text(manifest_text(new), encoding="utf-8")
    present = (
        sorted(p.name for p in out.iterdir() if not is_stage_name(p.name)) if out.is_dir() else []
    )
    old = [n for n in present if n in earlier or n in new]
    swap_in(stage, out, old)
    removed = tuple(n for n in old if n not in new)
    kept = tuple(n for n in present if n not in old and n != MANIFEST)
    return Replaced(shown, tuple(new), removed, kept)


def swap_in(stage: Path, out: Path, old: Collection[str]) -> None:
    """Move the entries ``old`` of ``out`` into ``stage``'s trash and every entry of ``stage``
    into ``out``, with Ctrl-C held back until they are done: they take microseconds, and
    stopping halfway would leave two runs' files mixed. The caller has established that
    ``old`` is the tool's to remove."""
    stage, out = Path(stage).absolute(), Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    new = sorted(p.name for p in stage.iterdir())
    with _interrupts_held():
        trash = Path(tempfile.mkdtemp(prefix=".old-", dir=stage))
        for name in old:
            os.replace(out / name, trash / name)
        for name in new:
            os.replace(stage / name, out / name)
    # The stage (and the old entries in it) go when ``staging_dir`` ends.


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
    return name.startswith(".") and STAGE_PREFIX in name and name != MANIFEST


@contextmanager
def _interrupts_held() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP are remembered, not acted on, until the block ends, then
    delivered to the handlers they had (main thread only: signal handlers cannot be set
    elsewhere, and Python delivers signals to the main thread anyway)."""
    caught: list[int] = []

    def remember(signum: int, frame: FrameType | None) -> None:
        caught.append(signum)

    held = [s for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP) if _handled(s)]
    try:
        with signal_handlers(held, remember):
            yield
    finally:
        if caught:
            if caught[0] == signal.SIGINT:
                raise KeyboardInterrupt
            signal.raise_signal(caught[0])


def _handled(signum: int) -> bool:
    """Whether Python handles ``signum`` now (an ignored signal stays ignored)."""
    return signal.getsignal(signum) not in (signal.SIG_IGN, None)
