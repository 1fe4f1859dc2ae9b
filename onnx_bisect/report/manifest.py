"""What the tool wrote in an output directory, so that a rerun replaces that and nothing else.

``--out DIR`` is often a directory the user already has. A rerun replaces the tool's earlier
files as a set, and the only safe proof that a ``repro/`` or a ``report.md`` there is the
tool's is a record the tool made when it wrote it: ``.onnx-bisect-manifest.json``, swapped in
with the files it lists. An entry the tool needs whose name is taken by anything the manifest
does not list (the user's file, or an older version's output, which kept no manifest) is
refused before any work, never replaced.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable
from pathlib import Path

from onnx_bisect.errors import InputError
from onnx_bisect.version import VERSION

__all__ = ["MANIFEST", "check_owned", "manifest_text", "read_manifest"]

MANIFEST = ".onnx-bisect-manifest.json"
_TOOL = "onnx-bisect"


def manifest_text(entries: Iterable[str]) -> str:
    """The manifest listing ``entries`` (names directly in the output directory)."""
    listed = sorted(set(entries) - {MANIFEST})
    body = {"tool": _TOOL, "version": VERSION, "entries": listed}
    return json.dumps(body, indent=2) + "\n"


def read_manifest(out: Path, option: str = "--out") -> frozenset[str]:
    """The entries ``out``'s manifest lists (none without a manifest). A file of that name
    that is not one of ours is refused: it would be overwritten."""
    path = Path(out) / MANIFEST
    if not path.is_file() and not path.is_symlink():
        return frozenset()
    try:
        body = json.loads(path.read_text(encoding="utf-8"))
        entries = body["entries"] if body.get("tool") == _TOOL else None
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        entries = None
    if not isinstance(entries, list) or not all(_plain(e) for e in entries):
        raise InputError(
            f"{option} {out}: {MANIFEST} there is not an onnx-bisect manifest, and onnx-bisect "
            "would overwrite it; remove it or choose another directory"
        )
    return frozenset(entries)


def check_owned(out: Path, names: Collection[str], option: str = "--out") -> frozenset[str]:
    """The entries of ``out`` the tool wrote earlier (its manifest lists them), which a new run
    may replace. Raise ``InputError`` when one of ``names`` (what the tool may write) is taken
    by an entry the tool did not write."""
    out = Path(out)
    if not out.is_dir():
        return frozenset()
    listed = read_manifest(out, option)
    taken = sorted(n for n in names if n not in listed and _exists(out / n))
    if taken:
        more = f" (and {len(taken) - 1} more)" if len(taken) > 1 else ""
        whose = (
            f"no {MANIFEST} there lists it"
            if listed
            else f"there is no {MANIFEST}: a file of yours, or an onnx-bisect output older "
            "than the manifest"
        )
        raise InputError(
            f"{option} {out}: {taken[0]}{more} was not written by onnx-bisect ({whose}), and "
            "onnx-bisect writes that name; move it away, or choose another directory"
        )
    return frozenset(n for n in listed if _exists(out / n))


def _plain(name: object) -> bool:
    """A name directly in the directory: a manifest never reaches outside it."""
    return isinstance(name, str) and name not in ("", ".", "..", MANIFEST) and "/" not in name


def _exists(path: Path) -> bool:
    return path.exists() or path.is_symlink()
