"""Hostile input: an ``--out`` that is not the tool's to replace, and names that would break a
report.

``--out`` cases: each is an exit-2 line on stderr, no traceback, and nothing the tool did not
write is created, changed or removed (the whole tree is compared before and after). Names:
a model whose node names hold a newline, backticks, ``<script>`` and a pipe, written into a
directory whose path holds a space; report.md's rows stay rows, the Mermaid block stays
statements, the page shows the names as text and the shown commands are one shell word per
path.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import tracemalloc
import zipfile
from pathlib import Path

import numpy as np
import onnx
import psutil
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnx_bisect
from onnx_bisect.cli import bisect_entry, main_entry
from onnx_bisect.engine.oracle import float64
from onnx_bisect.report.files import REPORT_FILES
from onnx_bisect.report.manifest import MANIFEST, manifest_text
from tests.browser import chromium, close, open_page
from tests.llama_model import LLAMA_BYTES, down_proj, write_external_llama
from tests.models import FAULTY_RUNTIME, chain, make, write_external_mlp

ROOT = Path(__file__).resolve().parent.parent


def tree(root: Path) -> dict[str, bytes | str]:
    """Every entry under ``root``, hidden ones too: a file's bytes, a link's target, "dir"."""
    found: dict[str, bytes | str] = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_symlink():
            found[rel] = "-> " + os.readlink(path)
        elif path.is_dir():
            found[rel] = "dir"
        else:
            found[rel] = path.read_bytes()
    return found


def cli(capsys: pytest.CaptureFixture[str], *args: str, main: bool = False) -> tuple[int, str]:
    """``bisect ARGS`` (``onnx-bisect ARGS`` with ``main``) in-process: exit code, stderr."""
    with pytest.raises(SystemExit) as exit_:
        (main_entry if main else bisect_entry)(list(args))
    code = exit_.value.code
    return (code if isinstance(code, int) else 0), capsys.readouterr().err


def refused(code: int, err: str, *words: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: --out "), err
    for word in words:
        assert word in err, err


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "models" / "tiny.onnx"
    path.parent.mkdir()
    onnx.save(chain(2), path)
    return path


def user_dir(path: Path, entry: str) -> Path:
    """``path`` holding the user's ``entry`` (a directory with a file in it, or a file)."""
    path.mkdir(parents=True, exist_ok=True)
    if "." in entry:
        (path / entry).write_text("mine\n")
    else:
        (path / entry).mkdir()
        (path / entry / "mine.py").write_text("print('mine')\n")
    return path


# --- --out is the tool's own -------------------------------------------------------------


@pytest.mark.parametrize("entry", ["repro", "explorer", "report.md", "inputs.npz"])
def test_a_name_the_tool_writes_taken_by_the_user_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, model: Path, entry: str
) -> None:
    out = user_dir(tmp_path / "u", entry)
    before = tree(tmp_path)
    code, err = cli(capsys, str(model), "--target", "cpu", "--out", str(out))
    refused(code, err, entry, "not written by onnx-bisect", "choose another directory")
    assert tree(tmp_path) == before


def test_a_symlinked_out_is_resolved_first(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, model: Path
) -> None:
    user_dir(tmp_path / "u", "repro")
    (tmp_path / "link").symlink_to(tmp_path / "u", target_is_directory=True)
    before = tree(tmp_path)
    code, err = cli(capsys, str(model), "--target", "cpu", "--out", str(tmp_path / "link"))
    refused(code, err, "repro")
    assert tree(tmp_path) == before


def test_out_dot_is_checked_like_any_directory(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    model: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(user_dir(tmp_path / "u", "repro"))
    before = tree(tmp_path)
    refused(*cli(capsys, str(model), "--target", "cpu", "--out", "."), "repro")
    assert tree(tmp_path) == before


def test_the_directory_holding_the_model_is_refused(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    model: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(model.parent)
    before = tree(tmp_path)
    refused(*cli(capsys, "tiny.onnx", "--target", "cpu", "--out", "."), "tiny.onnx is in .")
    refused(*cli(capsys, "tiny.onnx", "-t", "cpu", "-o", str(model.parent)), "tiny.onnx is in")
    assert tree(tmp_path) == before


def test_a_model_inside_an_entry_the_run_replaces_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, model: Path
) -> None:
    """``bisect report/repro/model.onnx --out report`` would replace the model it reads."""
    out = tmp_path / "report"
    (out / "repro").mkdir(parents=True)
    (out / MANIFEST).write_text(manifest_text(["repro"]))
    inside = out / "repro" / "model.onnx"
    inside.write_bytes(model.read_bytes())
    before = tree(tmp_path)
    code, err = cli(capsys, str(inside), "--target", "cpu", "--out", str(out))
    refused(code, err, "repro, which this run replaces")
    assert tree(tmp_path) == before


@pytest.mark.parametrize("where", ["/", "/etc", "/usr", "/var", "/proc"])
def test_root_and_system_directories_are_refused(
    capsys: pytest.CaptureFixture[str], model: Path, where: str
) -> None:
    before = sorted(os.listdir(where)) if where != "/proc" else None
    code, err = cli(capsys, str(model), "--target", "cpu", "--out", where)
    refused(code, err, "directory", "a directory of its own")
    if before is not None:
        assert sorted(os.listdir(where)) == before


def test_the_home_directory_is_refused(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    model: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    before = tree(tmp_path)
    refused(*cli(capsys, str(model), "--target", "cpu", "--out", str(home)), "home directory")
    assert tree(tmp_path) == before


def test_an_older_versions_output_is_refused_with_what_to_do(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, model: Path
) -> None:
    """Exactly the tool's names but no manifest: an output of a version before the manifest
    and a user's files look the same, so neither is replaced."""
    out = tmp_path / "old"
    out.mkdir()
    for name in ("report.md", "report.json", "inputs.npz"):
        (out / name).write_text("old\n")
    before = tree(tmp_path)
    code, err = cli(capsys, str(model), "--target", "cpu", "--out", str(out))
    refused(code, err, "inputs.npz (and 2 more)", f"there is no {MANIFEST}", "older")
    assert tree(tmp_path) == before


def test_a_manifest_that_is_not_ours_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, model: Path
) -> None:
    out = tmp_path / "u"
    out.mkdir()
    (out / MANIFEST).write_text('{"entries": ["../../etc"]}')
    before = tree(tmp_path)
    refused(*cli(capsys, str(model), "-t", "cpu", "-o", str(out)), "not an onnx-bisect manifest")
    assert tree(tmp_path) == before


def test_a_rerun_replaces_what_its_manifest_lists_and_nothing_else(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, model: Path
) -> None:
    out = tmp_path / "u"
    code, _ = cli(capsys, str(model), "--target", "cpu", "--out", str(out), "-f", "md,csv")
    assert code == 0
    assert sorted(os.listdir(out)) == [MANIFEST, "inputs.npz", "nodes.csv", "report.md"]
    (out / "notes.txt").write_text("mine\n")
    code, _ = cli(capsys, str(model), "--target", "cpu", "--out", str(out), "-f", "json")
    assert code == 0
    assert sorted(os.listdir(out)) == [MANIFEST, "inputs.npz", "notes.txt", "report.json"]
    assert (out / "notes.txt").read_text() == "mine\n"


def test_reduce_and_dump_share_the_rules(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, model: Path
) -> None:
    out = user_dir(tmp_path / "u", "repro.py")
    before = tree(tmp_path)
    code, err = cli(capsys, "reduce", str(model), "-t", "cpu", "-o", str(out), main=True)
    refused(code, err, "repro.py")
    code, err = cli(capsys, "dump", str(model), "-b", "cpu", "-o", str(model.parent), main=True)
    refused(code, err, "tiny.onnx is in")
    code, err = cli(capsys, "dump", str(model), "-b", "cpu", "-o", "/", main=True)
    refused(code, err, "the root directory")
    assert tree(tmp_path) == before


def test_the_console_script_refuses_in_one_line(tmp_path: Path, model: Path) -> None:
    """The tester's case, as typed: a real process, its stderr and exit code."""
    out = user_dir(tmp_path / "u", "repro")
    before = tree(tmp_path)
    script = Path(sys.executable).parent / "bisect"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [str(script), str(model), "--target", "cpu", "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    refused(done.returncode, done.stderr, "repro")
    assert done.stdout == ""
    assert tree(tmp_path) == before


# --- text that cannot break a report -----------------------------------------------------

NAMES = [
    "split\nline",
    "tick`name",
    "fault",
    "<script>window.__hit=1</script>",
    "pi|pe",
    "```fence",
    "mm3",
    "act3",
]


def hostile_model() -> onnx.ModelProto:
    """``chain(4)`` with hostile node names; ``fault`` is the node made wrong."""
    rng = np.random.default_rng(0)
    nodes, inits, prev = [], [], "x"
    for i in range(4):
        w = (rng.standard_normal((8, 8)) / np.sqrt(8)).astype(np.float32)
        inits.append(numpy_helper.from_array(w, f"W{i}"))
        hidden, out = f"h{i}", ("y" if i == 3 else f"a|{i}")
        nodes.append(helper.make_node("MatMul", [prev, f"W{i}"], [hidden], name=NAMES[2 * i]))
        nodes.append(helper.make_node("Tanh", [hidden], [out], name=NAMES[2 * i + 1]))
        prev = out
    return make(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])],
        inits,
    )


@pytest.fixture(scope="module")
def hostile_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("hostile")
    model = tmp / "hostile.onnx"
    onnx.save(hostile_model(), model)
    cmd = [sys.executable, str(FAULTY_RUNTIME), "{model}", "{inputs}", "{outputs}"]
    target = "exec:" + shlex.join([*cmd, "--fault", "fault=0.05"])
    out = tmp / "my out"
    with pytest.raises(SystemExit) as exit_:
        bisect_entry([str(model), "--target", target, "--out", str(out), "-q"])
    assert exit_.value.code == 1
    return out


def _unescaped_pipes(row: str) -> int:
    return len(re.findall(r"(?<!\\)\|", row))


def test_markdown_table_rows_stay_rows(hostile_out: Path) -> None:
    text = (hostile_out / "report.md").read_text()
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("| # | node |"))
    rows = []
    for line in lines[head + 2 :]:
        if not line.strip():
            break
        rows.append(line)
    assert len(rows) == len(NAMES)
    assert all(_unescaped_pipes(r) == _unescaped_pipes(lines[head]) for r in rows), rows
    assert rows[0].startswith("| 0 | `split\\nline` | MatMul |")
    assert rows[1].startswith("| 1 | `` tick`name `` | Tanh |")
    assert rows[4].startswith("| 4 | `pi\\|pe` | MatMul |")
    assert rows[5].startswith("| 5 | ```` ```fence ```` | Tanh |")
    # Each hostile name appears in no raw form anywhere: no line of it starts a new line.
    assert "\nline" not in text


def test_mermaid_block_holds_only_statements(hostile_out: Path) -> None:
    text = (hostile_out / "report.md").read_text()
    block = text.split("```mermaid\n", 1)[1].split("\n```\n", 1)[0].splitlines()
    statement = re.compile(
        r'flowchart LR|  n\d+\["[^"`<>]*"\]|  n\d+ --> n\d+|  n\d+ -\.->(\|"[^"]*"\|)? n\d+'
        r"|  classDef \w+ [\w:#,.-]+|  class [n\d,]+ \w+"
    )
    labels = [s.replace("<br/>", "") for s in block]
    for line in labels:
        assert statement.fullmatch(line), line
    assert any("#lt;script#gt;" in line for line in block)
    assert any("tick#96;name" in line for line in block)


def test_next_steps_quote_paths_with_spaces(hostile_out: Path) -> None:
    text = (hostile_out / "report.md").read_text()
    repro = hostile_out / "repro"
    cd = re.search(r"Reproduce it: `([^`]*)`", text)
    assert cd is not None
    assert shlex.split(cd.group(1)) == ["cd", str(repro), "&&", "python", "repro.py"]
    view = re.search(r"Look at it: `([^`]*)`", text)
    assert view is not None and shlex.split(view.group(1)) == [
        "onnx-bisect",
        "view",
        str(hostile_out),
    ]
    readme = (repro / "README.md").read_text()
    found = readme.split("## Found with\n\n", 1)[1].split("\n", 1)[1].split("\n```", 1)[0]
    argv = shlex.split(found)
    assert argv[argv.index("--out") + 1] == str(hostile_out)


def test_repro_docs_keep_names_in_code_spans(hostile_out: Path) -> None:
    issue = (hostile_out / "repro" / "issue.md").read_text()
    # The title names the program the command runs, not the whole command line.
    assert issue.startswith("# `faulty_runtime.py` diverges from `ONNX Runtime ")
    title = issue.splitlines()[0]
    assert title.endswith("at `fault` (culprit)")
    head = next(i for i, s in enumerate(issue.splitlines()) if s.startswith("| # | node |"))
    rows = issue.splitlines()[head + 2 :]
    rows = rows[: next((i for i, r in enumerate(rows) if not r.strip()), len(rows))]
    assert rows and all(_unescaped_pipes(r) == 9 for r in rows), rows


def test_the_page_shows_names_as_text(hostile_out: Path) -> None:
    page_text = (hostile_out / "report.html").read_text()
    assert "<script>window.__hit" not in page_text
    assert "&lt;script&gt;window.__hit=1&lt;/script&gt;" in page_text
    browser = chromium()
    if browser is None:
        pytest.skip("chromium is not installed (Debian: apt-get install chromium)")
    page = open_page(browser, (hostile_out / "report.html").as_uri())
    try:
        assert page.evaluate("document.body.dataset.ready") == "1"
        assert page.evaluate("window.__hit === undefined")
        names = page.evaluate(
            "[...document.querySelectorAll('#nodes tbody tr')].map(r => r.dataset.name)"
        )
        assert names == NAMES
        assert "<script>window.__hit=1</script>" in page.evaluate("document.body.innerText")
    finally:
        close(page)


def test_every_report_file_is_named_in_the_manifest(hostile_out: Path) -> None:
    listed = set(json_entries(hostile_out))
    assert listed == {p.name for p in hostile_out.iterdir()} - {MANIFEST}
    assert listed <= set(REPORT_FILES)


def json_entries(out: Path) -> list[str]:
    import json

    body = json.loads((out / MANIFEST).read_text())
    assert body["tool"] == "onnx-bisect" and body["version"]
    entries: list[str] = body["entries"]
    return entries


# --- Lifecycle: signals, the user's weights, children that hang (issue 26.2-26.4, 28.1) ----
# Each case runs the console script in a real process, with a TMPDIR of its own so that a
# temporary folder left behind is seen, and checks: the exit code, one line on stderr and no
# traceback, no process of the run left, no temporary or staging folder left, the user's
# weight file with its one link and the model loadable with plain onnx.load.

BIN = Path(sys.executable).parent
WAIT_S = 180.0  # two shared cores and a Python start per run: generous, never a sleep
posix_only = pytest.mark.skipif(sys.platform != "linux", reason="POSIX signals, flock, /proc")


@pytest.fixture(scope="module")
def big_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """96 MiB of external weights: over LINK_MIN_BYTES, so runs share the weight file rather
    than copy the bytes they use, and over the 64 MiB where the float64 oracle used to fail."""
    path = tmp_path_factory.mktemp("big") / "mlp.onnx"
    write_external_mlp(path, blocks=3, width=2048, hidden=4096)
    return path


def slow_target(marks: Path, *flags: str, sleep: float = 1.5) -> str:
    cmd = [sys.executable, str(FAULTY_RUNTIME), "{model}", "{inputs}", "{outputs}"]
    more = ["--fault", "mm1=0.05", "--sleep", str(sleep), "--mark", str(marks), *flags]
    return "exec:" + shlex.join([*cmd, *more])


def start_bisect(tmp_path: Path, model: Path, *args: str) -> subprocess.Popen[str]:
    tmp = tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, TMPDIR=str(tmp), PYTHONPATH=path)
    return subprocess.Popen(
        [str(BIN / "bisect"), str(model), *args],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def wait_runs(proc: subprocess.Popen[str], marks: Path, count: int) -> list[str]:
    """The target's runs marked so far, once there are ``count`` (the process still running)."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        lines = marks.read_text().splitlines() if marks.exists() else []
        if len(lines) >= count:
            return lines
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"bisect ended (exit {proc.returncode}) too early: {out}{err}")
        time.sleep(0.05)
    proc.kill()
    pytest.fail(f"no run {count} within {WAIT_S:g} s")


def finish(proc: subprocess.Popen[str], sig: int | None = None) -> tuple[int, str, str]:
    if sig is not None:
        proc.send_signal(sig)
    try:
        out, err = proc.communicate(timeout=WAIT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"bisect did not end within {WAIT_S:g} s")
    return proc.returncode, out, err


def ours_alive(marker: str) -> list[str]:
    """Processes whose command line or environment (TMPDIR) names ``marker``."""
    alive = []
    for p in psutil.process_iter():
        if p.pid == os.getpid():
            continue
        try:
            words = [*p.cmdline(), *p.environ().values()]
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if any(marker in w for w in words):
            alive.append(f"{p.pid}: {' '.join(p.cmdline())}")
    return alive


def run_pid(folder: str) -> int:
    """The pid in a command's temporary folder's name, ``onnx-bisect-run-<pid>-XXXXXX``."""
    return int(folder.removeprefix("onnx-bisect-run-").split("-")[0])


def gone(pid: int) -> bool:
    """Whether ``pid`` has ended (a zombie that no init reaps, in a container, has)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def one_line(err: str, line: str) -> None:
    assert "Traceback" not in err, err
    assert err.strip() == line, err


def assert_left_nothing(tmp_path: Path, model: Path, out: Path) -> None:
    assert list((tmp_path / "tmp").iterdir()) == []  # no temporary folder
    staged = [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]
    assert staged == []  # no staging folder beside --out
    assert ours_alive(str(tmp_path)) == []
    data = model.with_name(model.name + ".data")
    if data.exists():
        assert data.stat().st_nlink == 1  # no link to the user's weights anywhere
    onnx.load(str(model))  # plain onnx.load: it refuses a weight file with two links


@posix_only
@pytest.mark.slow
def test_sigterm_during_isolation_of_an_external_data_model_leaves_nothing(
    tmp_path: Path, big_model: Path
) -> None:
    """The acceptance case: SIGTERM (a CI cancel) while the target runs an isolation model of
    a model with 96 MiB of external weights: exit 143, the exec: runtime ended, no temporary
    or staging folder, no extra link to the weights, and the model loads, also during the run."""
    marks, out = tmp_path / "marks", tmp_path / "out"
    proc = start_bisect(tmp_path, big_model, "-t", slow_target(marks), "-o", str(out))
    runs = wait_runs(proc, marks, 3)  # the screen, the scan, then the isolation model
    assert big_model.with_name("mlp.onnx.data").stat().st_nlink == 1  # while the runtime runs
    onnx.load(str(big_model))
    code, _, err = finish(proc, signal.SIGTERM)
    assert code == 143
    one_line(err, "terminated (SIGTERM)")
    assert len(marks.read_text().splitlines()) == len(runs) == 3  # stopped in the third run
    assert not out.exists()
    assert_left_nothing(tmp_path, big_model, out)


@posix_only
def test_sighup_stops_a_run_as_ctrl_c_does(tmp_path: Path, model: Path) -> None:
    marks, out = tmp_path / "marks", tmp_path / "out"
    target = slow_target(marks, sleep=2.0)
    proc = start_bisect(tmp_path, model, "-t", target, "-o", str(out))
    wait_runs(proc, marks, 1)
    code, _, err = finish(proc, signal.SIGHUP)
    assert code == 129
    one_line(err, "hung up (SIGHUP)")
    assert_left_nothing(tmp_path, model, out)


@posix_only
@pytest.mark.slow
def test_after_sigkill_the_next_run_removes_what_the_killed_one_left(
    tmp_path: Path, big_model: Path
) -> None:
    """SIGKILL runs no cleanup: the exec: runtime dies with its parent (the kernel's
    parent-death signal), and the next run sweeps the killed run's temporary folder (with its
    copy of the weights) and its staging folder, and only those."""
    marks, out = tmp_path / "marks", tmp_path / "out"
    proc = start_bisect(tmp_path, big_model, "-t", slow_target(marks, sleep=5), "-o", str(out))
    wait_runs(proc, marks, 3)
    proc.kill()
    proc.communicate()
    # At once, while the runtime would still be in its 5 s sleep had it not died with us.
    deadline = time.monotonic() + 2
    while ours_alive(str(marks)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ours_alive(str(marks)) == []
    left = sorted(p.name for p in (tmp_path / "tmp").iterdir())
    # Named by the process that ran the diagnosis: bisect's forked child (the parent waits,
    # to survive the reference's crash: process.survive_reference_crash), dead with it.
    assert len(left) == 1 and left[0].startswith("onnx-bisect-run-")
    assert gone(run_pid(left[0]))
    assert [p for p in tmp_path.iterdir() if p.name.startswith(".out.onnx-bisect-")]
    # A live concurrent run's folders are spared: one held by a process of its own.
    live = start_bisect(tmp_path, big_model, "-t", slow_target(tmp_path / "m2", sleep=30))
    wait_runs(live, tmp_path / "m2", 1)
    again = start_bisect(tmp_path, big_model, "-t", "cpu", "-o", str(out), "-q")
    code, _, err = finish(again)
    assert code == 0, err
    held = [p.name for p in (tmp_path / "tmp").iterdir()]
    assert len(held) == 1 and psutil.Process(run_pid(held[0])).ppid() == live.pid
    finish(live, signal.SIGTERM)
    assert_left_nothing(tmp_path, big_model, out)


@pytest.fixture(scope="module")
def llama_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama-style decoder (4 layers of RMSNorm, attention and gated MLP) with 84 MiB of
    random weights in one external file."""
    path = tmp_path_factory.mktemp("llama") / "llama.onnx"
    write_external_llama(path)
    assert path.with_name("llama.onnx.data").stat().st_size >= LLAMA_BYTES > 64 << 20
    return path


@posix_only
@pytest.mark.slow
def test_the_float64_oracle_runs_on_a_large_external_data_model_while_it_loads(
    tmp_path: Path, llama_model: Path
) -> None:
    """Issue 28.1: over 64 MiB of external weights the oracle failed on the tool's own hard
    link ("multiple hard links") and fell back to the slow reference evaluator. The target
    here loads the user's model with plain onnx.load at every run, so a link to the weights
    while the run is under way fails it; a 1% fault in a middle down_proj is named."""
    wrapper = tmp_path / "loads_the_model.py"
    wrapper.write_text(
        "import runpy, sys, onnx\n"
        "onnx.load(sys.argv[1])\n"
        "sys.argv = sys.argv[2:]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    cmd = [sys.executable, str(wrapper), str(llama_model), str(FAULTY_RUNTIME)]
    fault = ["--fault", f"{down_proj(1)}=0.01"]
    target = "exec:" + shlex.join([*cmd, "{model}", "{inputs}", "{outputs}", *fault])
    out = tmp_path / "out"
    code, stdout, err = finish(start_bisect(tmp_path, llama_model, "-t", target, "-o", str(out)))
    assert code == 1, stdout + err
    report = json.loads((out / "report.json").read_text())
    assert report["root_cause"]["nodes"] == [down_proj(1)]
    oracle = [n for n in report["notes"] if n.startswith("--threshold auto:")]
    assert len(oracle) == 1, report["notes"]
    # torch in float64, and no reason why another was not used (an oracle that failed first).
    assert re.fullmatch(
        r"--threshold auto: float64 values from torch \S+ cpu dtype=float64 threads=\d+ fallback=1",
        oracle[0],
    )
    assert_left_nothing(tmp_path, llama_model, out)


def test_a_threshold_that_fell_back_is_said_next_to_the_verdict(
    tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Where no float64 oracle can run (here: a weight limit of 0 bytes, as for a model over
    2 GB), the terminal's first lines say that the threshold fell back, and to what."""
    monkeypatch.setattr(float64, "FLOAT64_MAX_WEIGHTS", 0)
    monkeypatch.setattr(float64, "FLOAT64_ORACLES", (("ref?dtype=float64", "ref"),))
    with pytest.raises(SystemExit) as exit_:
        bisect_entry([str(model), "-t", "cpu", "-o", str(tmp_path / "out")])
    assert exit_.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("No divergence"), lines
    assert lines[1].startswith("warning: --threshold auto: no float64 values (no float64 oracle")
    assert "fell back to rel_l2 > 1e-3" in " ".join(lines[1:3])


@posix_only
def test_a_runtime_that_leaves_a_process_holding_stderr_does_not_hang_the_tool(
    tmp_path: Path, model: Path
) -> None:
    """Issue 26.4: a runtime that starts ``sleep &`` before it runs holds its stderr open in a
    process that outlives it; the tool read until end of file, forever. Now it reads until
    the runtime exits, and what it left in its process group goes with it."""
    runtime = shlex.join([sys.executable, str(FAULTY_RUNTIME), "{model}", "{inputs}", "{outputs}"])
    target = "exec:" + shlex.join(["bash", "-c", f"sleep 987.25 & exec {runtime}"])
    out = tmp_path / "out"
    proc = start_bisect(tmp_path, model, "-t", target, "-o", str(out), "--timeout", "60")
    started = time.monotonic()
    code, stdout, err = finish(proc)
    assert code == 0, stdout + err  # the same numbers: no divergence, and no timeout either
    assert time.monotonic() - started < 60
    assert "Traceback" not in err
    assert [p.pid for p in psutil.process_iter() if "987.25" in " ".join(_cmdline(p))] == []
    assert_left_nothing(tmp_path, model, out)


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return []


@posix_only
@pytest.mark.slow
def test_a_hang_is_reported_as_a_hang_of_the_node(tmp_path: Path, model: Path) -> None:
    """A runtime that hangs whenever mm1 is in the model: ``--timeout`` kills its whole group
    at each try, and the finding is a hang localized to mm1, not a crash of everything."""
    marks, out = tmp_path / "marks", tmp_path / "out"
    target = slow_target(marks, "--hang-on", "mm1", sleep=0)
    proc = start_bisect(tmp_path, model, "-t", target, "-o", str(out), "--timeout", "3")
    code, stdout, err = finish(proc)
    assert code == 1, stdout + err
    assert "Traceback" not in err
    cause = json.loads((out / "report.json").read_text())["root_cause"]
    assert cause["nodes"] == ["mm1"] and cause["kind"] == "crash", cause
    assert "hangs (timed out after 3 s) whenever MatMul 'mm1' is in the model" in cause["reason"]
    assert "Identity" not in stdout
    assert_left_nothing(tmp_path, model, out)


# --- every bad input is exit 2 before allocation (issue 26 scope 5) ------------------------
# Each case: exit 2, one line on stderr, no traceback, nothing created outside --out (the
# temp directory included), and the refusal comes from a header or a shape, before the bytes
# it promises are allocated or read.


def bad_input(code: int, err: str, *words: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: "), err
    for word in words:
        assert word in err, err


# onnxruntime's own file: importing it (in a runtime's or the oracle's process) writes its
# session id to $TMPDIR/.ses, once, and never removes it.
ORT_SESSION_FILE = ".ses"


@pytest.fixture
def own_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A temp directory of this test's own, so that a leftover temp folder is seen. It holds
    onnxruntime's session file from the start, as /tmp does on any machine that ran it."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    (tmp / ORT_SESSION_FILE).write_text("0\n")
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    return tmp


def kept(found: dict[str, bytes | str]) -> dict[str, bytes | str]:
    """``found`` but the bytes of onnxruntime's session file, which its import rewrites."""
    return {k: (v if Path(k).name != ORT_SESSION_FILE else "") for k, v in found.items()}


def refused_input(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, own_tmp: Path, *args: str
) -> str:
    """``bisect ARGS --out tmp/out``, which must be refused with nothing left anywhere; the
    error line. numpy's allocations are traced: the refusal must come before them."""
    before = kept(tree(tmp_path))
    tracemalloc.start()
    try:
        code, err = cli(capsys, *args, "--out", str(tmp_path / "out"))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    bad_input(code, err)
    assert kept(tree(tmp_path)) == before
    assert peak < 256 << 20, f"{peak} bytes traced before the refusal"
    return err


def tensor_pb(path: Path, dims: list[int], raw: bytes, name: str = "x") -> Path:
    t = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=dims, raw_data=raw)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(t.SerializeToString())
    return path


def npz_member(path: Path, name: str, header: dict[str, object], body: bytes) -> None:
    """A deflated .npz member: an .npy ``header`` (its word on shape and dtype) and ``body``."""
    with (
        zipfile.ZipFile(path, "a", compression=zipfile.ZIP_DEFLATED) as zf,
        zf.open(name, "w", force_zip64=True) as f,
    ):
        np.lib.format.write_array_header_1_0(f, header)
        f.write(body)


def test_a_shape_beyond_the_budget_is_refused_before_allocation(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, own_tmp: Path, model: Path
) -> None:
    """``--shape`` × dtype against --max-memory, then against the machine (2.9 TiB each)."""
    err = refused_input(capsys, tmp_path, own_tmp, str(model), "-t", "cpu", "--shape", "x=1e11x8")
    assert "--shape 'x=1e11x8': dims must be integers" in err
    args = (str(model), "-t", "cpu", "--shape", "x=100000000000x8")
    err = refused_input(capsys, tmp_path, own_tmp, *args)
    assert err.startswith("error: --max-memory 4294967296 cannot hold the generated inputs"), err
    assert "'x': 100000000000x8 float32), 3200000000000 bytes (2.91 TiB)" in err
    err = refused_input(capsys, tmp_path, own_tmp, *args, "--max-memory", "1e15")
    assert "2.91 TiB, more than this machine has free" in err


def test_pb_inputs_are_checked_from_their_dims_before_reading(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, own_tmp: Path, model: Path
) -> None:
    case = tmp_path / "case"
    tensor_pb(case / "input_0.pb", [1_000_000, 1_000_000], b"\0" * 64)  # 1e12 elements
    err = refused_input(capsys, tmp_path, own_tmp, str(model), "-t", "cpu", "-i", str(case))
    assert "cannot hold inputs" in err and "input_0.pb, 4000000000000 bytes" in err
    tensor_pb(case / "input_0.pb", [2, 8], b"\0" * 60)  # 15 floats for 16
    err = refused_input(capsys, tmp_path, own_tmp, str(model), "-t", "cpu", "-i", str(case))
    assert "input_0.pb: its dims (2x8) do not match the data it holds" in err
    (case / "input_0.pb").write_bytes(b"\xff\xff garbage \x00\x01")
    err = refused_input(capsys, tmp_path, own_tmp, str(model), "-t", "cpu", "-i", str(case))
    assert "input_0.pb: not a TensorProto" in err
    (case / "input_0.pb").unlink()
    (case / "input_0.pb").symlink_to("/dev/zero")
    err = refused_input(capsys, tmp_path, own_tmp, str(model), "-t", "cpu", "-i", str(case))
    assert "input_0.pb: not a regular file" in err


def test_an_npz_input_is_checked_from_its_headers_and_never_unpickled(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, own_tmp: Path, model: Path
) -> None:
    """A bomb (a header claiming 2.9 TiB over a short deflated stream) is refused from its
    header in no time; a pickled array is refused without being unpickled."""
    bomb = tmp_path / "bomb.npz"
    huge = {"descr": "<f4", "fortran_order": False, "shape": (100_000_000_000, 8)}
    npz_member(bomb, "x.npy", huge, b"not even deflated zeros")
    start = time.monotonic()
    err = refused_input(capsys, tmp_path, own_tmp, str(model), "-t", "cpu", "-i", str(bomb))
    assert time.monotonic() - start < 5
    assert "cannot hold inputs" in err and "3200000000000 bytes" in err
    pickled = tmp_path / "pickled.npz"
    # numpy writes the pickle itself; the payload would run code if it were ever loaded.
    np.savez(pickled, x=np.array([{"would": "unpickle"}], dtype=object))
    err = refused_input(capsys, tmp_path, own_tmp, str(model), "-t", "cpu", "-i", str(pickled))
    assert "x.npy holds Python objects (a pickle), which are never unpickled" in err
    assert "allow_pickle=False" in err
    wrong = tmp_path / "wrong.npz"
    npz_member(wrong, "x.npy", {**huge, "shape": (2, 9)}, b"garbage, never read")
    err = refused_input(capsys, tmp_path, own_tmp, str(model), "-t", "cpu", "-i", str(wrong))
    assert "input 'x' has shape (2, 9) but dim 1 must be 8" in err


@pytest.fixture
def dumped(tmp_path: Path, model: Path) -> Path:
    """A real dump of the model on cpu."""
    with pytest.raises(SystemExit) as exit_:
        main_entry(["dump", str(model), "-b", "cpu", "-o", str(tmp_path / "dump"), "-q"])
    assert exit_.value.code == 0
    return tmp_path / "dump"


@pytest.mark.parametrize("flaw", ["garbage .pb", "pickled .npz", ".pb linked to /dev/zero"])
def test_a_dump_holding_a_bad_file_is_refused(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    own_tmp: Path,
    model: Path,
    dumped: Path,
    flaw: str,
) -> None:
    if flaw == "garbage .pb":
        (dumped / "junk.pb").write_bytes(b"garbage\xff\xff\x01")
        expected = "junk.pb: not a TensorProto"
    elif flaw == "pickled .npz":
        np.savez(dumped / "extra.npz", y=np.array([{"a": 1}], dtype=object))
        expected = "extra.npz: y.npy holds Python objects (a pickle), which are never unpickled"
    else:
        (dumped / "zero.pb").symlink_to("/dev/zero")
        expected = "zero.pb: not a regular file"
    err = refused_input(capsys, tmp_path, own_tmp, str(model), "-t", f"dump:{dumped}")
    assert err.startswith(f"error: dump {dumped}/"), err
    assert expected in err


def test_extra_arrays_in_a_runtimes_outputs_are_never_read(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, own_tmp: Path, model: Path
) -> None:
    """The protocol ignores extra arrays, so they are never decompressed: here one claims
    2.9 TiB over a stream that is not even deflate data; reading it would fail."""
    wrapper = tmp_path / "runtime.py"
    wrapper.write_text(
        "import runpy, shutil, sys, zipfile\n"
        "import numpy as np\n"
        "try:\n"
        f"    runpy.run_path({str(FAULTY_RUNTIME)!r}, run_name='__main__')\n"
        "except SystemExit as done:\n"
        "    assert not done.code, done.code\n"
        "with zipfile.ZipFile(sys.argv[3], 'a', compression=zipfile.ZIP_DEFLATED) as zf:\n"
        "    with zf.open('extra.npy', 'w', force_zip64=True) as f:\n"
        "        np.lib.format.write_array_header_1_0(\n"
        "            f, {'descr': '<f4', 'fortran_order': False, 'shape': (10**11, 8)})\n"
        "        f.write(b'never read')\n"
        f"shutil.copy(sys.argv[3], {str(tmp_path / 'written.npz')!r})\n"
    )
    cmd = [sys.executable, str(wrapper), "{model}", "{inputs}", "{outputs}"]
    out = tmp_path / "out"
    args = [str(model), "-t", "exec:" + shlex.join(cmd), "--threshold", "1e-3", "-q"]
    code, err = cli(capsys, *args, "--out", str(out), "-f", "json")
    assert (code, err) == (0, "")
    with zipfile.ZipFile(tmp_path / "written.npz") as zf:  # what the runtime wrote
        assert zf.namelist() == ["y.npy", "extra.npy"]
    report = json.loads((out / "report.json").read_text())
    assert (report["verdict"], report["runs"]["target"]) == ("match", 1)
    assert report["outputs"][0]["tensor"] == "y"
    assert os.listdir(own_tmp) == [ORT_SESSION_FILE]


def test_debug_never_changes_an_exit_code(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    model: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An internal error is exit 3 with or without --debug (which adds the traceback), both
    inside a command's own handling and after it (the summary printed last)."""
    import onnx_bisect.report as report
    from onnx_bisect.cli import commands

    def boom(*_a: object, **_k: object) -> None:
        raise RuntimeError("planted")

    args = [str(model), "-t", "cpu"]
    for where, name in ((commands, "run_bisect"), (report, "print_summary")):
        with monkeypatch.context() as patch:
            patch.setattr(where, name, boom)
            code, err = cli(capsys, *args)
            assert code == 3, err
            assert err.startswith("error: internal error: RuntimeError: planted"), err
            assert len(err.strip().splitlines()) == 1, err
            code, err = cli(capsys, *args, "--debug")
            assert code == 3, err
            assert "Traceback" in err and "RuntimeError: planted" in err


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_a_nonfinite_constant_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, own_tmp: Path, model: Path, value: str
) -> None:
    err = refused_input(capsys, tmp_path, own_tmp, str(model), "-t", "cpu", "--value", f"x={value}")
    assert err.startswith(f"error: --value: x={float(value)} is not finite"), err
    assert "--allow-nonfinite" in err


def test_nonfinite_given_inputs_are_refused_unless_allowed(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, own_tmp: Path, model: Path
) -> None:
    """Refused by default; allowed, the diagnosis still finds the planted fault (the metrics
    cover the elements finite in both)."""
    x = np.random.default_rng(0).random((2, 8)).astype(np.float32)
    x[0, 0] = np.nan
    given = tmp_path / "nan.npz"
    np.savez(given, x=x)
    err = refused_input(capsys, tmp_path, own_tmp, str(model), "-t", "cpu", "-i", str(given))
    assert "the given input 'x' holds NaN" in err and "--allow-nonfinite" in err
    cmd = [sys.executable, str(FAULTY_RUNTIME), "{model}", "{inputs}", "{outputs}"]
    target = "exec:" + shlex.join([*cmd, "--fault", "mm1=0.05"])
    out = tmp_path / "out"
    args = [str(model), "-t", target, "-i", str(given), "--threshold", "1e-3", "-q"]
    code, err = cli(capsys, *args, "--allow-nonfinite", "--out", str(out), "-f", "json")
    assert code == 1, err
    report = json.loads((out / "report.json").read_text())
    assert report["root_cause"]["nodes"] == ["mm1"]
    assert "input 'x' holds 1 NaN and 0 Inf of 16 elements (allowed)" in report["notes"][0]
    with pytest.raises(onnx_bisect.InputError, match="allow_nonfinite must be True or False"):
        onnx_bisect.BisectOptions(allow_nonfinite="yes")  # type: ignore[arg-type]


def test_a_dataset_input_holding_nan_is_refused_before_any_run(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, own_tmp: Path, model: Path
) -> None:
    frames = tmp_path / "frames"
    frames.mkdir()
    x = np.random.default_rng(0).random((1, 8)).astype(np.float32)
    np.savez(frames / "a.npz", x=x)
    x[0, 3] = np.inf
    np.savez(frames / "b.npz", x=x)
    err = refused_input(
        capsys, tmp_path, own_tmp, str(model), "-t", "cpu", "--dataset", str(frames)
    )
    assert err.startswith(f"error: --dataset {frames / 'b.npz'}: the given input 'x' holds Inf"), (
        err
    )


def test_a_pickled_split_dataset_is_refused_unread(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, own_tmp: Path, model: Path
) -> None:
    rows = tmp_path / "rows.npz"
    np.savez(rows, x=np.array([{"would": "unpickle"}], dtype=object))
    err = refused_input(capsys, tmp_path, own_tmp, str(model), "-t", "cpu", "--dataset", str(rows))
    assert err.startswith(f"error: --dataset {rows}: x.npy holds Python objects"), err


# --- malformed models, paths, runtimes that lie (issue 26 scope 7) --------------------------
# Inputs the tool must refuse: exit 2, one line, no traceback, and nothing outside --out
# created or removed (the model's folder and the temp directory included).


def _malformed(tmp_path: Path, kind: str) -> Path:
    """A model path of the given ``kind`` of damage, under tmp_path/models."""
    folder = tmp_path / "models"
    folder.mkdir(exist_ok=True)
    path = folder / "bad.onnx"
    good = chain(2)
    if kind == "missing":
        return folder / "nowhere.onnx"
    if kind == "directory":
        path.mkdir()
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "text":
        path.write_text("this is not a model\n")
    elif kind == "truncated":
        data = good.SerializeToString()
        path.write_bytes(data[: len(data) // 2])
    elif kind == "no-weights-file":
        onnx.save(good, path, save_as_external_data=True, location="w.bin", size_threshold=0)
        (folder / "w.bin").unlink()
    elif kind == "escaping-weights":
        onnx.save(good, path, save_as_external_data=True, location="w.bin", size_threshold=0)
        for init in good.graph.initializer:
            init.ClearField("raw_data")
            init.data_location = TensorProto.EXTERNAL
            del init.external_data[:]
            init.external_data.add(key="location", value="../../../etc/passwd")
        path.write_bytes(good.SerializeToString())
    elif kind == "cycle":
        nodes = [
            helper.make_node("Relu", ["b"], ["a"], name="r1"),
            helper.make_node("Relu", ["a"], ["b"], name="r2"),
            helper.make_node("Add", ["x", "b"], ["y"], name="add"),
        ]
        f = TensorProto.FLOAT
        onnx.save(
            make(
                nodes,
                [helper.make_tensor_value_info("x", f, [1, 4])],
                [helper.make_tensor_value_info("y", f, [1, 4])],
            ),
            path,
        )
    elif kind == "unknown-op":
        f = TensorProto.FLOAT
        node = helper.make_node("Frobnicate", ["x"], ["y"], name="frob", domain="com.nowhere")
        m = make(
            [node],
            [helper.make_tensor_value_info("x", f, [1, 4])],
            [helper.make_tensor_value_info("y", f, [1, 4])],
        )
        m.opset_import.append(helper.make_opsetid("com.nowhere", 1))
        onnx.save(m, path)
    else:
        raise AssertionError(kind)
    return path


MALFORMED = [
    "missing",
    "directory",
    "empty",
    "text",
    "truncated",
    "no-weights-file",
    "escaping-weights",
    "cycle",
    "unknown-op",
]


@pytest.mark.parametrize("kind", MALFORMED)
def test_a_malformed_model_is_refused_in_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, own_tmp: Path, kind: str
) -> None:
    path = _malformed(tmp_path, kind)
    before = kept(tree(tmp_path))
    code, err = cli(capsys, str(path), "-t", "cpu", "--out", str(tmp_path / "out"))
    bad_input(code, err)
    assert kept(tree(tmp_path)) == before


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--input", "nowhere.npz"),
        ("--input", "models"),  # a directory
        ("--out", "models/tiny.onnx"),  # a file, the model itself
        ("--dataset", "nowhere"),
        ("--target-model", "nowhere.onnx"),
    ],
)
def test_a_bad_path_is_refused_in_one_line(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    own_tmp: Path,
    model: Path,
    flag: str,
    value: str,
) -> None:
    before = kept(tree(tmp_path))
    args = [str(model), "-t", "cpu", flag, str(tmp_path / value)]
    if flag != "--out":
        args += ["--out", str(tmp_path / "out")]
    code, err = cli(capsys, *args)
    bad_input(code, err)
    assert kept(tree(tmp_path)) == before
    onnx.load(str(model))


# A runtime that runs onnxruntime honestly except where node ``mm1`` is in the model, and
# there lies in one way (about mm1's output and what follows it, as a broken mm1 would):
# the finding is exit 1 at mm1, whatever the lie.
LIAR = """
import sys, os, signal
import numpy as np, onnx, onnxruntime as ort
model, inputs, outputs, how = sys.argv[1:5]
m = onnx.load(model)
if any(n.name == "mm1" for n in m.graph.node):
    if how == "no-outputs":
        sys.exit(0)
    if how == "segfault":
        os.kill(os.getpid(), signal.SIGSEGV)
    if how == "flood":
        sys.stdout.write("x" * (32 << 20))
        sys.stdout.flush()
        sys.exit(7)
    if how == "garbage":
        open(outputs, "wb").write(b"PK\\x03\\x04 not a zip")
        sys.exit(0)
feeds = dict(np.load(inputs))
sess = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
names = [o.name for o in sess.get_outputs()]
values = sess.run(names, feeds)
# mm1's output and what follows it (h1, y) are the ones a broken mm1 gets wrong.
after = {"h1", "y"}
if how == "wrong-shape":
    values = [v.reshape(-1)[:1] if n in after else v for n, v in zip(names, values)]
if how == "missing-output":
    keep = [i for i, n in enumerate(names) if n not in after]
    names, values = [names[i] for i in keep], [values[i] for i in keep]
np.savez(outputs, **dict(zip(names, values)))
"""


@pytest.mark.parametrize(
    "how", ["no-outputs", "segfault", "flood", "garbage", "wrong-shape", "missing-output"]
)
def test_a_runtime_that_lies_is_a_finding_at_its_node(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, own_tmp: Path, model: Path, how: str
) -> None:
    liar = tmp_path / "liar.py"
    liar.write_text(LIAR)
    target = "exec:" + shlex.join([sys.executable, str(liar)]) + " {model} {inputs} {outputs} "
    out = tmp_path / "out"
    before = kept(tree(tmp_path))
    code, err = cli(capsys, str(model), "-t", target + how, "--out", str(out))
    assert code == 1, err
    assert "Traceback" not in err
    cause = json.loads((out / "report.json").read_text())["root_cause"]
    assert cause["nodes"] == ["mm1"], cause
    after = {k: v for k, v in tree(tmp_path).items() if k != "out" and not k.startswith("out/")}
    assert kept(after) == before
    onnx.load(str(model))
