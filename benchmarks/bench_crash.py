"""What crash safety costs: a full diagnosis of YOLOv8n-320 with the runtimes in this process
(``--no-isolate-crashes``) against the default (each runtime in a long-lived worker process)
and, once per repetition if asked, ``--isolate-crashes`` (a fresh process per run).

    python benchmarks/bench_crash.py --repeat 5 [--nudenet PATH] [--target openvino]
        [--before TREE]

``--before TREE``: the same modes also with the package of another checkout (``git archive
COMMIT | tar -x -C TREE``), interleaved with this one's, for a before/after on one load.

The commands are interleaved per repetition, so that a change in the machine's load falls on
every mode alike; the medians of wall time and of CPU time (user + system of the whole tree)
are printed and written to ``DIR/bench-crash.json``. Exit 0 whatever the numbers (a
measurement, not a test); 1 when a command failed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_yolo import console_script, find_nudenet, load_average  # noqa: E402

# Runs argv[2:], then writes {"rc", "wall_s", "cpu_s"} as JSON to argv[1].
_WRAPPER = (
    "import json,resource,subprocess,sys,time\n"
    "t=time.perf_counter()\n"
    "rc=subprocess.run(sys.argv[2:],stdout=subprocess.DEVNULL,stderr=subprocess.DEVNULL)"
    ".returncode\n"
    "wall=time.perf_counter()-t\n"
    "r=resource.getrusage(resource.RUSAGE_CHILDREN)\n"
    "open(sys.argv[1],'w').write(json.dumps({'rc':rc,'wall_s':wall,"
    "'cpu_s':r.ru_utime+r.ru_stime}))\n"
)
MODES = {
    "in process (--no-isolate-crashes)": ["--no-isolate-crashes"],
    "default (persistent worker)": [],
    "--isolate-crashes (child per run)": ["--isolate-crashes"],
}


def measure(argv: list[str], tree: Path | None = None) -> dict[str, Any]:
    """``argv`` run and measured; with ``tree``, with that checkout's package, from its
    folder (``python -m`` puts the working folder first: the worker must import it too)."""
    fd, name = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    env = None if tree is None else dict(os.environ, PYTHONPATH=str(tree))
    try:
        wrapper = [sys.executable, "-c", _WRAPPER, name, *argv]
        subprocess.run(wrapper, check=False, env=env, cwd=tree)
        data: dict[str, Any] = json.loads(Path(name).read_text())
        return data
    finally:
        Path(name).unlink(missing_ok=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--nudenet", type=Path)
    parser.add_argument("--target", default="openvino")
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    parser.add_argument("--no-fresh", action="store_true", help="skip --isolate-crashes")
    parser.add_argument("--before", type=Path, help="another checkout's tree, measured too")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    model, why = find_nudenet(args.nudenet, args.out)
    bisect = console_script("bisect")
    if model is None or bisect is None:
        print(f"skipped: {why or 'no bisect console script'}")
        return 0
    model = model.resolve()  # the commands of --before run in its folder
    modes = {k: v for k, v in MODES.items() if not (args.no_fresh and "--isolate" in k)}
    trees: dict[str, Path | None] = {"": None}
    if args.before is not None:
        here = Path(__file__).resolve().parent.parent
        trees = {"before: ": args.before.resolve(), "after: ": here}
    modes = {f"{t}{k}": v for t in trees for k, v in modes.items()}
    samples: dict[str, list[dict[str, Any]]] = {k: [] for k in modes}
    load_before = load_average()
    for i in range(args.repeat):
        for mode, flags in modes.items():
            cmd = [str(bisect), str(model), "--ref", "cpu", "--target", args.target]
            out = (args.out / "crash-report").resolve()
            cmd += ["--shape", "images=1,3,320,320", "--out", str(out)]
            tree = next((path for t, path in trees.items() if t and mode.startswith(t)), None)
            sample = measure([*cmd, *flags], tree)
            if sample["rc"] not in (0, 1):
                print(f"{mode}: exit {sample['rc']}: {' '.join(cmd + flags)}")
                return 1
            samples[mode].append(sample)
            wall, cpu = sample["wall_s"], sample["cpu_s"]
            print(f"{i + 1}/{args.repeat} {mode}: {wall:.2f} s, cpu {cpu:.2f} s")
    table = {}
    print(f"\nYOLOv8n-320, --target {args.target}, median of {args.repeat}")
    print(f"{'mode':46} {'wall s':>7} {'vs in process':>13} {'cpu s':>7} {'vs':>7}")
    for mode in modes:
        # Each tree against its own in-process mode.
        prefix = next(t for t in trees if mode.startswith(t))
        first = next(m for m in modes if m.startswith(prefix))
        base = statistics.median(s["wall_s"] for s in samples[first])
        base_cpu = statistics.median(s["cpu_s"] for s in samples[first])
        wall = statistics.median(s["wall_s"] for s in samples[mode])
        cpu = statistics.median(s["cpu_s"] for s in samples[mode])
        table[mode] = {"wall_s": wall, "cpu_s": cpu, "samples": samples[mode]}
        more, more_cpu = wall / base - 1, cpu / base_cpu - 1
        print(f"{mode:46} {wall:7.2f} {more:+13.1%} {cpu:7.2f} {more_cpu:+7.1%}")
    print(f"load average: {load_before} at start, {load_average()} at end")
    (args.out / "bench-crash.json").write_text(json.dumps(table, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
