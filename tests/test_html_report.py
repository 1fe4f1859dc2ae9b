"""report.html and error_curve.png: a self-contained page with the summary, the error curve,
the root cause's neighbourhood and every node in a sortable, filterable table.

The browser test opens the page in headless Chromium (skipped, with the reason, where it is
not installed) and asserts that it makes no request but its own file, logs no console error,
and that its script sorts and filters.
"""

from __future__ import annotations

import html
import logging
import shlex
import sys
from html.parser import HTMLParser
from pathlib import Path

import onnx
import pytest
from PIL import Image
from typer.testing import CliRunner

import onnx_bisect
from onnx_bisect.cli import bisect_app
from onnx_bisect.report.files import write_reports
from onnx_bisect.report.html import CSP, render_html
from onnx_bisect.report.manifest import MANIFEST
from onnx_bisect.report.neighbourhood import MAX_NODES, neighbourhood
from onnx_bisect.report.plots import PLOTS_HINT
from onnx_bisect.result import BisectResult
from tests.browser import chromium, close, open_page
from tests.faulty import FaultyBackend, RefusingBackend
from tests.models import FAULTY_RUNTIME, YOLO, chain

FAULT = "/down1/conv/Conv"


@pytest.fixture(scope="module")
def result() -> BisectResult:
    return onnx_bisect.bisect(YOLO, target=FaultyBackend(FAULT))


class _Page(HTMLParser):
    """Every start tag with its attributes, and the text, of a page."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str]]] = []
        self.text: list[str] = []
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, {k: v or "" for k, v in attrs}))

    def handle_data(self, data: str) -> None:
        self.text.append(data)

    def find(self, tag: str, **attrs: str) -> list[dict[str, str]]:
        return [
            a for t, a in self.tags if t == tag and all(a.get(k) == v for k, v in attrs.items())
        ]


def test_the_page_loads_nothing_from_elsewhere(result: BisectResult) -> None:
    text = render_html(result)
    page = _Page(text)
    assert page.find("meta", **{"http-equiv": "Content-Security-Policy"}) == [
        {"http-equiv": "Content-Security-Policy", "content": CSP}
    ]
    links = [
        (tag, key, value)
        for tag, attrs in page.tags
        for key, value in attrs.items()
        if key in ("src", "href", "xlink:href", "action", "srcset", "poster", "data")
    ]
    assert all(v.startswith(("#", "data:")) for _, _, v in links), links
    # No address anywhere in an attribute, but the SVG namespaces (names, never fetched).
    addresses = [
        (tag, key, value)
        for tag, attrs in page.tags
        for key, value in attrs.items()
        if "//" in value and not key.startswith("xmlns")
    ]
    assert addresses == []
    assert not [t for t, _ in page.tags if t in ("link", "iframe", "object", "embed", "base")]
    assert "@import" not in text
    assert text.count("url(") == text.count("url(#")


def test_the_page_holds_the_summary(result: BisectResult) -> None:
    text = render_html(result)
    assert result.root_cause is not None and result.first_divergence is not None
    assert result.first_divergence.name == FAULT and result.root_cause.nodes == (FAULT,)
    assert '<span class="verdict diverged">Diverged</span>' in text
    assert f"<dt>First divergence</dt><dd>Conv <code>{FAULT}</code> (#4): rel_l2 = 0.05" in text
    assert f"<dt>Root cause</dt><dd><b>culprit</b>: <code>{FAULT}</code>." in text
    assert html.escape(result.root_cause.reason) in text
    assert "<dt>Amplification chain</dt><dd>Conv /down1/conv/Conv 0.05 →" in text
    assert f"<code>{html.escape(result.criterion.describe())}</code>" in text


def test_every_node_is_a_row_with_controls_to_sort_and_filter(result: BisectResult) -> None:
    page = _Page(render_html(result))
    rows = [a for t, a in page.tags if t == "tr" and "data-verdict" in a]
    assert [r["data-name"] for r in rows] == [n.name for n in result.nodes]
    assert [r["data-verdict"] for r in rows] == [n.verdict.value for n in result.nodes]
    assert [r["data-op"] for r in rows] == [n.op_type for n in result.nodes]
    verdicts = {n.verdict.value for n in result.nodes}
    options = [a["value"] for t, a in page.tags if t == "option"]
    assert options == ["", *sorted(verdicts), "", *sorted({n.op_type for n in result.nodes})]
    assert page.find("select", id="f-verdict") and page.find("select", id="f-op")
    assert page.find("input", id="f-name", type="search")
    headers = page.find("th", **{"data-type": "num"}) + page.find("th", **{"data-type": "str"})
    assert len(headers) == 9
    culprit = next(n for n in result.nodes if n.name == FAULT)
    assert f'data-v="{culprit.accumulated_error!r}"' in render_html(result)


def test_the_curve_is_an_inline_matplotlib_svg(result: BisectResult) -> None:
    pytest.importorskip("matplotlib")
    text = render_html(result)
    figure = text[text.index('<div class="figure"><svg') :]
    figure = figure[: figure.index("</svg>")]
    assert '<g id="figure_1">' in figure and '<g id="axes_1">' in figure  # matplotlib's
    for label in (
        "accumulated (full run)",
        "isolated (fed the reference",
        "threshold (k × noise + eps)",
        "fp32 noise floor",
        "first divergence",
        "root cause (culprit)",
    ):
        assert label in figure, label


def test_the_graph_shows_the_root_cause_and_its_chain(result: BisectResult) -> None:
    hood = neighbourhood(result)
    assert hood is not None
    by_index = {n.index: n for n in hood.nodes}
    assert [by_index[i].name for i in hood.centre] == [FAULT]
    assert 4 < len(hood.nodes) <= MAX_NODES
    assert all(u < v and u in by_index and v in by_index for u, v in hood.edges)
    # The chain's first links are all drawn, joined by real edges.
    head = [c.index for c in result.chain[:8]]
    assert set(head) <= set(by_index)
    assert all((a, b) in hood.edges for a, b in zip(head, head[1:], strict=False))
    steps = set(zip(head, head[1:], strict=False))
    assert steps <= hood.chain_steps
    text = render_html(result)
    assert '<g class="node v-culprit centre" transform="translate(' in text
    assert f"<title>#4 Conv {FAULT}\nverdict: culprit" in text


def test_error_curve_png_is_a_png(result: BisectResult, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    written = write_reports(result, tmp_path, ["png"])
    assert written == [tmp_path / "error_curve.png", tmp_path / "inputs.npz"]
    with Image.open(tmp_path / "error_curve.png") as image:
        assert image.format == "PNG"
        assert image.size == (1500, 630)  # 10 × 4.2 inches at 150 dpi


def test_without_matplotlib_the_page_says_how_to_get_the_plot(
    result: BisectResult,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # ``import matplotlib`` now fails
    caplog.set_level(logging.WARNING)
    written = write_reports(result, tmp_path, ["html", "png"])
    assert written == [tmp_path / "report.html", tmp_path / "inputs.npz"]
    text = (tmp_path / "report.html").read_text()
    assert (
        f'<p class="note">The plot needs matplotlib: <code>{html.escape(PLOTS_HINT)}</code>' in text
    )
    assert 'class="figure"' not in text
    assert 'class="node v-culprit centre"' in text and text.count("<tr data-verdict=") == len(
        result.nodes
    )
    assert caplog.messages == [f"error_curve.png not written: it needs matplotlib ({PLOTS_HINT})"]


def test_a_match_is_a_page_too(tmp_path: Path) -> None:
    path = tmp_path / "chain.onnx"
    onnx.save(chain(3), path)
    text = render_html(onnx_bisect.bisect(path, target="cpu"))
    assert '<span class="verdict match">No divergence</span>' in text
    assert "<svg" not in text  # no node was probed: no curve, no graph
    assert "Root cause neighbourhood" not in text


def test_a_target_that_cannot_run_a_node_is_quoted_and_drawn() -> None:
    result = onnx_bisect.bisect(chain(3), target=RefusingBackend("Tanh"))
    text = render_html(result)
    assert "<dt>Root cause</dt><dd><b>unsupported</b>: <code>act0</code>." in text
    assert "The target said:<pre>op Tanh is not implemented (node act0)</pre>" in text
    assert '<p class="note">No node has a measured error to draw.</p>' in text
    assert '<g class="node v-unsupported centre"' in text


def test_bisect_writes_the_page_and_the_image_by_default(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    model = tmp_path / "chain.onnx"
    onnx.save(chain(4), model)
    cmd = [sys.executable, str(FAULTY_RUNTIME), "{model}", "{inputs}", "{outputs}"]
    target = "exec:" + shlex.join([*cmd, "--fault", "mm1=0.05"])
    out = tmp_path / "out"
    run = CliRunner().invoke(bisect_app, [str(model), "--target", target, "--out", str(out)])
    assert run.exit_code == 1, run.output
    assert {"report.html", "error_curve.png", "report.md"} <= {p.name for p in out.iterdir()}
    text = (out / "report.html").read_text()
    assert f"<pre>cd {out / 'repro'} &amp;&amp; python repro.py" in text
    assert "<b>culprit</b>: <code>mm1</code>" in text

    only = tmp_path / "only"
    run = CliRunner().invoke(
        bisect_app, [str(model), "--target", target, "--out", str(only), "--format", "html"]
    )
    assert run.exit_code == 1, run.output
    names = sorted(p.name for p in only.iterdir())
    assert names == [MANIFEST, "inputs.npz", "report.html", "repro"]


def test_the_page_in_a_browser(result: BisectResult, tmp_path: Path) -> None:
    browser = chromium()
    if browser is None:
        pytest.skip("chromium is not installed (Debian: apt-get install chromium)")
    path = tmp_path / "report.html"
    path.write_text(render_html(result))
    url = path.as_uri()
    page = open_page(browser, url, width=1280, height=1600)
    try:
        assert page.evaluate("document.body.dataset.ready") == "1"
        total = len(result.nodes)
        assert page.evaluate("document.getElementById('shown').textContent") == (
            f"{total} of {total} nodes shown"
        )
        # The wide graph opens scrolled to the root cause.
        assert page.evaluate("document.querySelector('.scroll').scrollLeft") > 0
        shown = page.evaluate(
            "(() => { const s = document.getElementById('f-verdict'); s.value = 'culprit';"
            " s.dispatchEvent(new Event('input'));"
            " return [document.getElementById('shown').textContent,"
            " [...document.querySelectorAll('#nodes tbody tr:not([hidden])')]"
            ".map(r => r.dataset.name)]; })()"
        )
        assert shown == [f"1 of {total} nodes shown", [FAULT]]
        worst = max(
            (n for n in result.nodes if n.accumulated_error is not None),
            key=lambda n: n.accumulated_error or 0.0,
        )
        first = page.evaluate(
            "(() => { const s = document.getElementById('f-verdict'); s.value = '';"
            " s.dispatchEvent(new Event('input'));"
            " [...document.querySelectorAll('#nodes th')][4].click();"
            " return document.querySelector('#nodes tbody tr').dataset.name; })()"
        )
        assert first == worst.name  # accumulated error, worst first
        shot = tmp_path / "report.png"
        page.screenshot(shot)
        # Filters from the address, as a link to a filtered table would carry them.
        for address in ("about:blank", url + "#op=Conv&name=down1"):  # a load, not a jump
            page.call("Page.navigate", url=address)
            page.wait_for("Page.loadEventFired")
        convs = sum(1 for n in result.nodes if n.op_type == "Conv" and "down1" in n.name)
        assert page.evaluate("document.getElementById('shown').textContent") == (
            f"{convs} of {total} nodes shown"
        )
        assert page.requests and {r.split("#")[0] for r in page.requests} - {"about:blank"} == {url}
        assert page.errors == []
    finally:
        close(page)
    with Image.open(shot) as image:
        assert image.format == "PNG" and 1200 < image.size[0] <= 1280  # less a scrollbar
