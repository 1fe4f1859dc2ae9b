"""What a person sees: the result's repr and summary, the terminal output at a terminal's width
and whole in a pipe, counts in proper English, and progress while a run goes on.

The CLI tests run the real console script with stdout and stderr on pseudo-terminals or pipes,
as a shell would give them; the target is an in-process adapter file (ONNX Runtime with the
example fault planted), so each run takes seconds, not the exec: runtime's process per run.
"""

from __future__ import annotations

import fcntl
import io
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from rich.console import Console

import onnx_bisect
from onnx_bisect.cli.output import UNWRAPPED
from onnx_bisect.compare.criterion import Criterion
from onnx_bisect.engine.judge import observer_problem
from onnx_bisect.engine.measure.observe import Observed
from onnx_bisect.report import print_summary
from onnx_bisect.report.format import chain_line, search_line, stage_runs_line
from onnx_bisect.report.issue import render_issue
from onnx_bisect.report.markdown import render_markdown
from onnx_bisect.result import BisectResult, CauseKind, RootCause, SearchInfo
from onnx_bisect.text import plural, runs_text
from tests.faulty import FaultyBackend
from tests.models import FAULTY_RUNTIME, ROOT, YOLO, make

BIN = Path(sys.executable).parent
FAULT = "/down1/conv/Conv"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


@pytest.fixture(scope="module")
def yolo() -> BisectResult:
    return onnx_bisect.bisect(YOLO, target=FaultyBackend(FAULT))


def one_node() -> onnx.ModelProto:
    """x -> Tanh ``only`` -> y: one node, one output, for the singular of every count."""
    node = helper.make_node("Tanh", ["x"], ["y"], name="only")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])
    return make([node], [x], [y])


# --- repr and summary() ---------------------------------------------------------------------


def test_repr_is_one_short_line(yolo: BisectResult) -> None:
    assert repr(yolo) == (
        f"<BisectResult diverged: first {FAULT}, culprit {FAULT}; {len(yolo.nodes)} nodes>"
    )
    assert len(yolo.nodes) == 192
    assert repr(yolo.nodes[4]) == f"<NodeResult #4 Conv {FAULT} culprit: acc 0.05 iso 0.05>"
    # The dataclass repr printed ~235 kB here: every node with its comparisons' metrics.
    assert len(repr(yolo.nodes)) < 192 * 100
    assert str(yolo) == repr(yolo)


def test_repr_stays_short_for_long_names_and_many_cause_nodes(yolo: BisectResult) -> None:
    names = tuple(f"/model/{'block' * 40}/node{i}" for i in range(20))
    cause = RootCause(CauseKind.PATTERN, names, "a window")
    text = repr(replace(yolo, root_cause=cause))
    assert len(text) < 300 and "\n" not in text
    assert text.endswith("/node2 +17 more; 192 nodes>") and "pattern …" in text


def test_repr_of_a_match_and_of_a_cause_without_nodes(yolo: BisectResult) -> None:
    match = onnx_bisect.bisect(one_node(), target="cpu?opt=disable")
    assert repr(match) == "<BisectResult match: 1 output agrees>"
    unknown = replace(yolo, root_cause=RootCause(CauseKind.NONE, (), "no single node"))
    assert repr(unknown) == f"<BisectResult diverged: first {FAULT}, no root cause; 192 nodes>"


def test_summary_is_the_head_of_the_terminal_output_without_markup(yolo: BisectResult) -> None:
    lines = yolo.summary().splitlines()
    assert lines[0] == f"Diverged: {yolo.target.spec} vs cpu on {YOLO}"
    assert lines[1] == "  output output0: diverged, rel_l2=0.002064 max_abs=0.06416"
    assert lines[2] == (
        f"First divergence: Conv {FAULT} (#4) tensor {FAULT}_output_0: "
        "rel_l2=0.05 max_abs=0.02119 cosine=1"
    )
    assert re.fullmatch(
        rf"Root cause \(culprit\): {FAULT} — Conv '{FAULT}' diverges on its own when fed the "
        r"reference's inputs \(rel_l2=0\.05 > threshold [0-9.e-]+\)",
        lines[3],
    )
    assert len(lines) == 4 and "[" not in yolo.summary()
    printed = io.StringIO()
    print_summary(yolo, Console(file=printed, width=UNWRAPPED))
    assert printed.getvalue().startswith(yolo.summary() + "\n")


def test_summary_of_a_match_and_a_failure_quotes_the_target(yolo: BisectResult) -> None:
    match = onnx_bisect.bisect(one_node(), target="cpu?opt=disable")
    assert re.fullmatch(
        r"No divergence: cpu\?opt=disable vs cpu on <in-memory ModelProto>: 1 output agrees: "
        r"rel_l2 0 ≤ 4 × fp32 noise \+ 1e-05 = [0-9.e-]+ \(\d+\.\d\ds\)",
        match.summary(),
    )
    said = "kernel missing:\n\n  Conv with group=3"
    failed = replace(yolo, root_cause=RootCause(CauseKind.UNSUPPORTED, (FAULT,), "no", said))
    tail = failed.summary().splitlines()[-4:]
    assert tail == ["The target said:", "  kernel missing:", "", "    Conv with group=3"]


# --- counts ---------------------------------------------------------------------------------


def test_plural_and_runs_text() -> None:
    assert [plural(n, "run") for n in (0, 1, 2)] == ["0 runs", "1 run", "2 runs"]
    assert [plural(n, "match", "matches") for n in (1, 3)] == ["1 match", "3 matches"]
    assert runs_text({"target": 2, "ref": 1, "float64": 0}) == "ref 1 run, target 2 runs"
    assert runs_text({}) == "no runs"


def test_one_node_one_run_one_window_read_in_the_singular(yolo: BisectResult) -> None:
    search = SearchInfo("asked", 1, ((3, True),), True, False, FAULT, 1)
    one = replace(yolo, search=search)
    assert search_line(one) == (
        f"cut search: 1 target run over 192 nodes (monotone), transition after {FAULT}, "
        "1 pattern window"
    )
    two = replace(yolo, search=replace(search, runs=2, pattern_windows_tried=2))
    assert "2 target runs over 192 nodes" in search_line(two)
    assert search_line(two).endswith(", 2 pattern windows")
    assert "(73 nodes)" in chain_line(yolo)


def test_a_one_node_model_reads_in_the_singular() -> None:
    result = onnx_bisect.bisect(one_node(), target=FaultyBackend("only"))
    assert result.diverged and len(result.nodes) == 1
    printed = io.StringIO()
    print_summary(result, Console(file=printed, width=UNWRAPPED))
    assert "Top 1 node by accumulated error" in printed.getvalue()
    assert "(the full table, 1 probed node, is in `nodes.csv`)" in render_markdown(result)
    assert "\n## Nodes around the root cause\n" in render_issue(result)


def test_observer_problem_says_differs_for_one_output() -> None:
    plain = Observed({}, {"output0": np.ones(4, np.float32)})
    one = Observed({}, {"output0": np.full(4, 2, np.float32)})
    assert "output0 differs from the plain run" in observer_problem(plain, one, Criterion())
    plain2 = Observed({}, {"a": np.ones(4, np.float32), "b": np.ones(4, np.float32)})
    two = Observed({}, {"a": np.full(4, 2, np.float32), "b": np.full(4, 2, np.float32)})
    assert "a, b differ from the plain run" in observer_problem(plain2, two, Criterion())


# --- progress hook --------------------------------------------------------------------------


@dataclass
class Recorder:
    """A ``Progress`` that keeps what it heard."""

    events: list[tuple[str, str]] = field(default_factory=list)
    runs: dict[str, Mapping[str, int]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def phase_started(self, phase: str) -> None:
        with self.lock:
            self.events.append(("start", phase))

    def run_done(self, phase: str, runs: Mapping[str, int]) -> None:
        with self.lock:
            self.events.append(("run", phase))

    def phase_done(self, phase: str, seconds: float, runs: Mapping[str, int]) -> None:
        with self.lock:
            self.events.append(("done", phase))
            self.runs[phase] = runs


def test_progress_hears_each_phase_and_counts_its_runs_where_they_ran() -> None:
    heard = Recorder()
    result = onnx_bisect.bisect(YOLO, target=FaultyBackend(FAULT), progress=heard)
    assert result.root_cause is not None and result.root_cause.nodes == (FAULT,)
    # The float64 oracle runs in its own thread beside the screen; the reference's half of a
    # pair runs in a worker: each run still lands in the phase that asked for it.
    assert heard.runs == {
        "load": {},
        "float64": {"float64": 2},
        "screen": {"ref": 1, "target": 1},
        "scan": {"ref": 1, "target": 1},
        "isolate": {"target": 1},
    }
    for phase in heard.runs:
        assert heard.events.count(("start", phase)) == heard.events.count(("done", phase)) == 1
    assert heard.events.count(("run", "screen")) == 2
    assert sum(sum(r.values()) for r in heard.runs.values()) == sum(result.runs.values())


# --- the console script in a terminal and in a pipe -----------------------------------------

PLANTED = """
import importlib.util

from onnx_bisect import BackendBase, create_backend

_spec = importlib.util.spec_from_file_location("faulty_runtime", {runtime!r})
_runtime = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_runtime)


class Planted(BackendBase):
    def __init__(self, spec):
        super().__init__(spec)
        self.cpu = create_backend("cpu")

    def _run(self, model, feeds):
        return self.cpu.run(_runtime.plant_fault(model, {node!r}, 0.05), feeds)
"""


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("adapter") / "planted.py"
    path.write_text(PLANTED.format(runtime=str(FAULTY_RUNTIME), node=FAULT))
    return f"{path}:Planted"


@dataclass(frozen=True)
class Ran:
    code: int
    stdout: str  # escape codes removed, line ends as written
    stderr: str
    stderr_raw: bytes


def run_cli(*args: str, tty: tuple[bool, bool], env: Mapping[str, str] | None = None) -> Ran:
    """The bisect console script with stdout and stderr each a terminal (80 columns wide, as
    the kernel says; COLUMNS unset) or a pipe, per ``tty``."""
    environ = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    environ = {k: v for k, v in environ.items() if k not in ("FORCE_COLOR", "NO_COLOR")}
    environ |= {"TERM": "xterm-256color", "PYTHONPATH": str(ROOT), **(env or {})}
    parents, children = [], []
    for is_tty in tty:
        if is_tty:
            parent, child = pty.openpty()
            fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
        else:
            parent, child = os.pipe()
        parents.append(parent)
        children.append(child)
    proc = subprocess.Popen(
        [str(BIN / "bisect"), *args],
        stdin=subprocess.DEVNULL,
        stdout=children[0],
        stderr=children[1],
        cwd=ROOT,
        env=environ,
    )
    for child in children:
        os.close(child)
    chunks: list[list[bytes]] = [[], []]

    def drain(fd: int, into: list[bytes]) -> None:
        while True:
            try:
                data = os.read(fd, 65536)
            except OSError:  # EIO: the terminal's other end is closed
                break
            if not data:
                break
            into.append(data)

    pairs = zip(parents, chunks, strict=True)
    readers = [threading.Thread(target=drain, args=pair) for pair in pairs]
    for r in readers:
        r.start()
    code = proc.wait(timeout=300)
    for r, p in zip(readers, parents, strict=True):
        r.join(timeout=30)
        os.close(p)
    out, err = (b"".join(c) for c in chunks)

    def plain(raw: bytes) -> str:
        return ANSI.sub("", raw.decode()).replace("\r\n", "\n")

    return Ran(code, plain(out), plain(err), err)


def test_a_pipe_gets_every_line_whole_and_no_progress(planted: str) -> None:
    # COLUMNS is what a terminal would have; a pipe is not one, so it must not matter.
    ran = run_cli(str(YOLO), "--target", planted, tty=(False, False), env={"COLUMNS": "60"})
    assert ran.code == 1, ran.stdout + ran.stderr
    lines = ran.stdout.splitlines()
    assert lines[0] == f"Diverged: {planted} vs cpu on {YOLO}"
    root = next(line for line in lines if line.startswith("Root cause"))
    assert root.startswith(f"Root cause (culprit): {FAULT} — Conv '{FAULT}' diverges on its own")
    assert root.endswith(")") and "threshold" in root
    # The full table at its natural width, each row on one line.
    assert any(
        line.startswith("│ 19 │ /c2f1/m.0/cv2/bn/BatchNormalization │ BatchNormalization │")
        for line in lines
    )
    assert max(len(line) for line in lines) > 100
    assert ran.stderr == ""


def test_a_terminal_80_columns_wide_gets_lines_of_80_and_a_live_progress_line(
    planted: str,
) -> None:
    ran = run_cli(str(YOLO), "--target", planted, tty=(True, True))
    assert ran.code == 1, ran.stdout + ran.stderr
    lines = ran.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80, ran.stdout
    assert " ".join(lines).count("diverges on its own when fed") == 1
    # The compact table: no op column, the node names whole.
    assert any(re.match(rf"\s*4\s+{FAULT}\s+culprit\s+0\.05\s+0\.05\s+—", line) for line in lines)
    # A name wider than its column breaks after a separator, not inside a word.
    row = next(i for i, line in enumerate(lines) if re.match(r"\s*19\s+/c2f1/m\.0/cv2/bn/\s", line))
    assert lines[row + 1].split() == ["BatchNormalization"]
    # Progress went to stderr, phase by phase with its runs and the elapsed time, and was
    # cleared before the summary.
    assert "screen: ref 1 run, target 1 run" in ran.stderr
    assert "scan: " in ran.stderr and re.search(r"\d:\d\d:\d\d", ran.stderr)
    assert "Diverged" not in ran.stderr


def test_quiet_in_a_terminal_prints_nothing_at_all(planted: str) -> None:
    ran = run_cli(str(YOLO), "--target", planted, "--quiet", tty=(True, True))
    assert ran.code == 1
    assert ran.stdout == "" and ran.stderr_raw == b""


def test_verbose_logs_each_phase_with_its_time_and_runs(planted: str) -> None:
    ran = run_cli(str(YOLO), "--target", planted, "-v", tty=(False, False))
    assert ran.code == 1, ran.stderr
    logged = ran.stderr.splitlines()
    phases = [re.sub(r"\d+\.\d\d s", "T s", line) for line in logged if " phase " in line]
    assert phases == [
        "INFO onnx_bisect.engine.progress: phase load done in T s (no runs)",
        "INFO onnx_bisect.engine.progress: phase float64 done in T s (float64 2 runs)",
        "INFO onnx_bisect.engine.progress: phase screen done in T s (ref 1 run, target 1 run)",
        "INFO onnx_bisect.engine.progress: phase scan done in T s (ref 1 run, target 1 run)",
        "INFO onnx_bisect.engine.progress: phase isolate done in T s (target 1 run)",
    ]
    decided = "the final outputs diverge; the scan strategy runs"
    assert f"INFO onnx_bisect.engine.diagnose: {decided}" in logged
    # Internals (probe chunks, tensor counts) are for --debug.
    assert not any("probes in" in line or "float64 reference:" in line for line in logged)


# --- words that agree with themselves (issue 35) ---------------------------------------------


def _printed(result: BisectResult, top: int) -> list[str]:
    out = io.StringIO()
    print_summary(result, Console(file=out, width=UNWRAPPED), top=top)
    return out.getvalue().splitlines()


def test_the_culprit_is_pinned_to_the_table_when_the_top_rows_leave_it_out(
    yolo: BisectResult,
) -> None:
    # The largest accumulated error is downstream (the Mul at #21, propagated): the top row
    # alone would hide the culprit.
    assert [n.name for n in yolo.top(1)] == ["/c2f1/m.0/cv2/Mul"]
    lines = _printed(yolo, top=1)
    title = next(line for line in lines if "by accumulated error" in line)
    assert title.strip() == (
        "Top 1 node by accumulated error, and the first divergence and root cause"
    )
    rows = [line for line in lines if line.startswith("│ ")]
    assert [r.split("│")[2].strip() for r in rows] == ["/c2f1/m.0/cv2/Mul", FAULT]
    assert rows[1].split("│")[4].strip() == "culprit"
    # Already among the top rows: nothing pinned, the title as it was.
    lines = _printed(yolo, top=2)
    assert any(line.strip() == "Top 2 nodes by accumulated error" for line in lines)


def test_run_counts_add_up_and_the_bundles_own_check_is_said_apart(yolo: BisectResult) -> None:
    stages = {"screen": 1, "scan": 1, "isolate": 1, "repro": 1, "repro check": 1}
    result = replace(yolo, runs={"ref": 2, "target": 4}, stage_runs=stages)
    line = stage_runs_line(result)
    assert line == (
        "target runs by stage: screen 1, scan 1, isolate 1, repro 1 (4 in all); "
        "and 1 by the repro bundle's own repro.py"
    )
    # A precision workaround's run is its own stage, not "other".
    from onnx_bisect.engine.measure.runs import RunStats

    stats = RunStats()
    stats.record("target", 0.1)
    stats.record("workaround", 0.1)
    assert stats.target_by_stage == {"other": 1, "workaround": 1}


def test_no_divergence_gives_the_measured_error_beside_the_bound() -> None:
    match = onnx_bisect.bisect(one_node(), target="cpu?opt=disable")
    [line] = match.summary().splitlines()
    assert re.fullmatch(
        r"No divergence: cpu\?opt=disable vs cpu on <in-memory ModelProto>: 1 output agrees: "
        r"rel_l2 0 ≤ 4 × fp32 noise \+ 1e-05 = [0-9.e-]+ \(\d+\.\d\ds\)",
        line,
    ), line
    md = render_markdown(match)
    assert re.search(r"every final output agrees: rel_l2 0 ≤ 4 × fp32 noise \+ 1e-05 = ", md)


def test_report_md_names_no_folder_it_was_not_given(yolo: BisectResult) -> None:
    # No bundle and no folder: no "onnx-bisect view OUT" with a made-up OUT.
    md = render_markdown(yolo)
    assert "onnx-bisect view" not in md and " OUT" not in md
    md = render_markdown(yolo, Path("my report"))
    assert "`onnx-bisect view 'my report'`" in md


def test_report_html_has_the_next_steps(yolo: BisectResult, tmp_path: Path) -> None:
    onnx_bisect.write_reports(yolo, tmp_path / "out", formats=["html", "explorer"])
    page = (tmp_path / "out" / "report.html").read_text()
    steps = page.split("<h2>Next steps</h2>")[1].split("</ol>")[0]
    assert f"<code>onnx-bisect view {tmp_path / 'out'}</code>" in steps
