"""What the docs say about the repository holds, where no example run would notice.

tests/test_docs.py runs the docs' examples; this checks their prose: every repository path a
page names exists, every link lands on a heading, the guide's "not built yet" list names
nothing the tool has, the README's commands use only real flags and backend specs, and every
install hint names an extra that pyproject.toml defines.
"""

from __future__ import annotations

import re
import shlex
import sys
import tomllib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import typer

from onnx_bisect.backends import ALIASES, adapters, create_backend, parse_spec
from onnx_bisect.cli import app, bisect_app
from onnx_bisect.errors import BackendError, BackendUnavailableError
from onnx_bisect.report.files import FORMATS, REPORT_FILES
from onnx_bisect.repro.bundle import BUNDLE_FILES
from tests.models import chain

ROOT = Path(__file__).resolve().parents[1]
PAGES = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
# A path whose first part is one of these is relative to the repository's root...
ROOTED = ("onnx_bisect", "examples", "benchmarks", "tests", "docs")
# ...and one that starts with a subpackage (`engine/judge.py`) is relative to the package.
SUBPACKAGES = sorted(
    p.name for p in (ROOT / "onnx_bisect").iterdir() if (p / "__init__.py").is_file()
)
# What `--out report` and a repro bundle hold: named in the guide as `report/inputs.npz`,
# they are output files, not the packages onnx_bisect/report and onnx_bisect/repro.
OUTPUT_PATHS = {f"report/{f}" for f in REPORT_FILES} | {f"repro/{f}" for f in BUNDLE_FILES}

_FENCE = re.compile(r"^```.*?^```[^\n]*$", re.S | re.M)
_CODE = re.compile(r"`([^`\n]+)`")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_BRACES = re.compile(r"\{([^{}]*,[^{}]*)\}")


def _page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def prose(page: Path) -> str:
    """The page without its fenced blocks (test_docs.py runs those)."""
    return _FENCE.sub("", page.read_text())


def named_paths(text: str) -> Iterator[str]:
    """Repository paths in the code spans of ``text``; ``{a,b}`` expanded."""
    for span in _CODE.findall(text):
        for token in span.split():
            for part in re.split(r"::|:", token.strip(".,;()'\"")):
                first = part.split("/")[0]
                if "/" in part and (first in ROOTED or first in SUBPACKAGES):
                    yield from _expand(part)


def _expand(path: str) -> Iterator[str]:
    m = _BRACES.search(path)
    if m is None:
        yield path
        return
    for choice in m[1].split(","):
        yield from _expand(path[: m.start()] + choice + path[m.end() :])


def missing(path: str) -> str | None:
    """None when ``path`` names something in the repository (a file, a folder, a glob's
    match, or ``module.NAME`` defined in module.py), else what is wrong."""
    if path.rstrip("/") in OUTPUT_PATHS:
        return None
    rel = path if path.split("/")[0] in ROOTED else f"onnx_bisect/{path}"
    if (ROOT / rel).exists() or ("*" in rel and any(ROOT.glob(rel))):
        return None
    module, _, name = rel.rpartition(".")
    source = ROOT / f"{module}.py"
    if name.isidentifier() and source.is_file():
        defined = rf"^\s*(?:def|class)\s+{name}\b|^{name}\s*[:=]"
        if re.search(defined, source.read_text(), re.M):
            return None
        return f"{module}.py defines no {name}"
    return f"{rel} does not exist"


def test_path_reader_reads_every_form() -> None:
    text = (
        "`onnx_bisect/backends/exec.py`, `engine/judge._constant`, `report/inputs.npz`, "
        "`backends/{ort,exec}.py`, `tests/test_docs.py::test_x`, `my_adapter.py:MyRuntime`, "
        "`exec:python examples/faulty_runtime.py {model}`"
    )
    assert list(named_paths(text)) == [
        "onnx_bisect/backends/exec.py",
        "engine/judge._constant",
        "report/inputs.npz",
        "backends/ort.py",
        "backends/exec.py",
        "tests/test_docs.py",
        "examples/faulty_runtime.py",
    ]
    assert [missing(p) for p in named_paths(text)] == [None] * 7
    assert missing("onnx_bisect/adapters/exec.py") == "onnx_bisect/adapters/exec.py does not exist"
    assert missing("engine/judge.nothing") == "onnx_bisect/engine/judge.py defines no nothing"


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_path_a_page_names_exists(page: Path) -> None:
    # All failures at once: a page that names moved modules is fixed in one pass.
    wrong = sorted({f"{p}: {why}" for p in named_paths(prose(page)) if (why := missing(p))})
    assert not wrong, f"{_page_id(page)} names paths that are not in the repository:\n" + (
        "\n".join(wrong)
    )


def heading_anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the page's headings: lowercase, punctuation dropped, spaces
    made hyphens, a repeated one numbered."""
    seen: Counter[str] = Counter()
    anchors = set()
    for line in prose(page).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m is None:
            continue
        slug = re.sub(r"[^\w\- ]", "", m[1].lower()).replace(" ", "-")
        anchors.add(slug if not seen[slug] else f"{slug}-{seen[slug]}")
        seen[slug] += 1
    return anchors


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_link_lands_on_a_file_and_heading(page: Path) -> None:
    wrong = []
    for target in _LINK.findall(prose(page)):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        linked = (page.parent / file).resolve() if file else page
        if not linked.exists():
            wrong.append(f"{target}: no file {file}")
        elif anchor and linked.suffix == ".md" and anchor not in heading_anchors(linked):
            wrong.append(f"{target}: {linked.name} has no heading #{anchor}")
    assert not wrong, f"{_page_id(page)} has broken links:\n" + "\n".join(wrong)


# --- the guide's "not built yet" list ------------------------------------------------------

_PLANNED = re.compile(r"^Not built yet \(planned\):(.*?)(?:\n\s*\n|\Z)", re.S | re.M)


def _built() -> dict[str, str]:
    """Words that name a part of the tool that exists, with what it is."""
    built = {f: f"a report format (--format {f})" for f in FORMATS}
    built |= {f.lower(): f"a report file ({f})" for f in REPORT_FILES}
    built |= {c: f"a command (onnx-bisect {c})" for c in _subcommands() if c != "run"}
    built |= {a: f"a backend ({a})" for a in (*adapters(), *ALIASES)}
    return built


def planned_but_built(text: str) -> list[str]:
    """What a "Not built yet (planned): ..." paragraph of ``text`` names that is built."""
    built = _built()
    return [
        f"{word!r}: {built[word]}"
        for planned in _PLANNED.findall(text)
        for word in dict.fromkeys(re.findall(r"[\w.+-]+", planned.lower()))
        if word in built
    ]


def test_planned_checker_catches_a_built_feature() -> None:
    # The line the guide carried after report.html was built.
    old = "Intro.\n\nNot built yet (planned): HTML reports.\n\n## A first run\n"
    assert planned_but_built(old) == ["'html': a report format (--format html)"]


def test_the_guide_plans_nothing_that_is_built() -> None:
    guide = (ROOT / "docs" / "guide.md").read_text()
    assert planned_but_built(guide) == []


# --- the README's commands ------------------------------------------------------------------

_SPEC_FLAGS = ("--target", "-t", "--ref", "-r", "--backend", "-b")


def readme_commands() -> Iterator[tuple[str, list[str]]]:
    """Each ``bisect``/``onnx-bisect`` line in the README's shell fences, as (line, words)."""
    for block in _FENCE.findall((ROOT / "README.md").read_text()):
        if block.startswith("```python"):
            continue
        # A trailing backslash continues a line, and so does an indented one (the synopsis).
        for line in re.sub(r"\\?\n(?=[ \t])", " ", block).splitlines():
            words = shlex.split(line.removeprefix("$ "), comments=True)
            if words and Path(words[0]).name in ("bisect", "onnx-bisect"):
                yield line, words


def _subcommands() -> dict[str, Any]:
    commands: dict[str, Any] = typer.main.get_command(app).commands  # type: ignore[attr-defined]
    return commands


def _command(words: list[str]) -> Any:
    if Path(words[0]).name == "bisect":
        return typer.main.get_command(bisect_app)
    return _subcommands()[words[1]]


def wrong_words(words: list[str]) -> list[str]:
    """The flags that the command does not take, and the backend specs that do not parse."""
    command = _command(words)
    flags = {"--help", "-h"} | {o for p in command.params for o in (*p.opts, *p.secondary_opts)}
    wrong = []
    # A synopsis writes [--flag VALUE | --other]: the brackets are not part of the flag.
    tokens = [w.strip("[]") for w in words]
    for token, value in zip(tokens, [*tokens[1:], ""], strict=True):
        if token.startswith("-") and token.split("=")[0] not in flags:
            wrong.append(f"{token}: not an option of {command.name}")
        spec = value if token in _SPEC_FLAGS and not value.isupper() else ""
        if spec and (why := _bad_spec(spec)) is not None:
            wrong.append(f"{spec}: {why}")
    return wrong


def _bad_spec(text: str) -> str | None:
    try:
        spec = parse_spec(text)
        if spec.name != "dump":  # a dump directory exists only where it was written
            create_backend(spec.without_transforms().text)
    except (BackendUnavailableError, BackendError):
        return None  # a real spec, for a runtime or device this machine lacks
    except Exception as exc:
        return str(exc)
    return None


def test_readme_commands_use_real_flags_and_specs() -> None:
    commands = list(readme_commands())
    assert len(commands) >= 8, "the README's commands were not found"
    wrong = [f"{line.strip()}\n  {w}" for line, words in commands for w in wrong_words(words)]
    assert not wrong, "README.md shows commands that do not work:\n" + "\n".join(wrong)


def test_readme_command_checker_catches_a_wrong_flag_and_spec() -> None:
    assert wrong_words(["bisect", "m.onnx", "--target", "warpdrive", "--outdir", "r"]) == [
        "warpdrive: unknown backend 'warpdrive'; known: "
        + ", ".join(sorted(set(adapters()) | set(ALIASES))),
        "--outdir: not an option of bisect",
    ]


# --- install hints ----------------------------------------------------------------------------

_EXTRAS = re.compile(r"(?:onnx-bisect|\.)\[([\w,-]+)\]")


def test_every_install_hint_names_a_defined_extra() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    defined = set(pyproject["project"]["optional-dependencies"])
    sources = [*PAGES, ROOT / "Makefile", *sorted((ROOT / "onnx_bisect").rglob("*.py"))]
    named = {
        (_page_id(f), extra)
        for f in sources
        for group in _EXTRAS.findall(f.read_text())
        for extra in group.split(",")
    }
    assert {e for _, e in named} >= {"torch", "openvino", "tract", "plots"}, "hints not found"
    assert sorted(f"{f}: [{e}]" for f, e in named if e not in defined) == []


# --- exec-protocol.md's promise about stderr --------------------------------------------------


def test_exec_protocol_keeps_what_it_says_of_stderr(tmp_path: Path) -> None:
    page = " ".join((ROOT / "docs" / "exec-protocol.md").read_text().split())
    assert "then the last 5 non-empty stderr lines joined by ` \\| `" in page
    assert "the whole stderr is kept as well (its last 20,000 characters, after a `…`," in page
    # A real exec: runtime that fails after 7 lines on stderr (one blank), after 30,000
    # characters more, or saying nothing.
    script = tmp_path / "rt.py"
    lines = ["line 0", "", *(f"line {i}" for i in range(1, 7))]
    script.write_text(
        "import sys\n"
        "if 'quiet' not in sys.argv:\n"
        f"    print({chr(10).join(lines)!r}, file=sys.stderr)\n"
        "if 'more' in sys.argv:\n"
        "    print('x' * 29_999 + 'y', file=sys.stderr)\n"
        "sys.exit(3)\n"
    )
    model = chain()
    feeds = {"x": np.ones((2, 8), np.float32)}
    spec = f"exec:{shlex.join([sys.executable, str(script)])} {{model}} {{inputs}} {{outputs}}"
    with pytest.raises(BackendError) as err:
        create_backend(spec).run(model, feeds)
    assert str(err.value) == f"{spec}: exited with code 3: " + " | ".join(
        f"line {i}" for i in range(2, 7)
    )
    whole = "\n".join(lines)
    assert err.value.full == f"{spec}: exited with code 3:\n{whole}"
    with pytest.raises(BackendError) as long:
        create_backend(f"{spec} more").run(model, feeds)
    kept = long.value.full.split(":\n", 1)[1]
    assert kept == "…" + ("x" * 29_999 + "y")[-20_000:]
    with pytest.raises(BackendError) as quiet:
        create_backend(f"{spec} quiet").run(model, feeds)
    assert str(quiet.value) == f"{spec} quiet: exited with code 3: (no stderr)"
    assert quiet.value.full == f"{spec} quiet: exited with code 3:\n(no stderr)"


# --- the guide, in a newcomer's order ------------------------------------------------------


def test_the_guide_reads_in_a_newcomers_order() -> None:
    guide = (ROOT / "docs" / "guide.md").read_text()
    heads = [
        "## Words the tool prints",
        "## A first run",
        "## Reading the answer",
        "### Exit codes",
        "## Inputs and shapes",
        "## What counts as diverged",
        "### Noise-floor thresholds (the default)",
        "## Lower precision",
        "## Your own runtime: `exec:`",
        "# Advanced",
    ]
    where = [guide.index("\n" + h) for h in heads]
    assert where == sorted(where), [
        h for h, _ in sorted(zip(heads, where, strict=True), key=lambda p: p[1])
    ]
    assert "## The Python API" not in guide  # its own page, docs/api.md


def test_the_glossary_names_every_word_the_tool_prints() -> None:
    from onnx_bisect.result import CauseKind, Verdict

    guide = (ROOT / "docs" / "guide.md").read_text()
    glossary = guide.split("## Words the tool prints", 1)[1].split("\n## ", 1)[0]
    words = {f"`{v.value}`" for v in (*Verdict, *CauseKind)} - {"`precision`"} | {
        "**first divergence**", "**root cause**", "**accumulated error**", "**isolated error**",
        "**amplification**", "**amplification chain**", "**threshold**", "**precision floor**",
        "**within precision**", "**Precision lowered by the runtime**", "**workaround**",
        "**repro bundle**", "**verified**", "**task check**", "**The target said**",
        "**NaN first appears**", "**Optimizer pass**", "**runs**", "**target runs by stage**",
        "**note:**", "**warning:**", "**screen**", "**scan**", "**isolate**", "**strategy**",
        "**float64 oracle**", "**probed tensor**", "**not-probed**",
    }  # fmt: skip
    missing = sorted(w for w in words if w not in glossary)
    assert not missing, f"docs/guide.md's glossary lacks {missing}"
    assert "`precision` (within what a" in glossary
