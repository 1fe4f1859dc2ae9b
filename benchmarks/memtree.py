#!/usr/bin/env python3
"""Peak resident memory of a whole process tree, and conv nets whose activations are huge.

    python benchmarks/memtree.py [--interval 0.02] -- COMMAND [ARG ...]
    python benchmarks/memtree.py --build-conv OUT.onnx --blocks 28 --size 512

``measure(argv)`` runs a command and samples, every ``interval`` seconds in a thread, the
resident set (``VmRSS`` of ``/proc/PID/status``) of the command's process and of every process
below it, and keeps the peak of their SUM: onnx-bisect, the runtimes it loads in-process and
the ``exec:`` runtimes and sandboxes it starts are counted together, as the kernel must hold
them together. (``getrusage``'s ``ru_maxrss`` is the peak of the largest single process, not
of the sum.) A child that lives less than one interval can be missed; the runtimes measured
here live hundreds of milliseconds at least.

``conv_net`` builds the model the memory budget is tested on: ``blocks`` residual blocks of a
3x3 depthwise Conv, Relu, 1x1 Conv and Add on a 1x64xHxW float32 tensor, so every
intermediate is 64*H*W*4 bytes while the weights are a few kilobytes. Used by
tests/test_memory.py and benchmarks/bench_memory.py.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = ["CHANNELS", "TreePeak", "conv_net", "intermediate_bytes", "measure", "tree_rss"]

CHANNELS = 64


@dataclass(frozen=True)
class TreePeak:
    """What ``measure`` saw: exit status, wall time, and peaks in bytes. ``peak_tree`` is the
    largest sum over the tree at one sample; ``peak_main`` and ``peak_children`` the largest
    of the command's own process and of the sum of its descendants, each at its own time."""

    returncode: int
    wall_s: float
    peak_tree: int
    peak_main: int
    peak_children: int
    samples: int
    most_processes: int


def _rss(pid: int) -> int:
    """Resident bytes of ``pid``; 0 for a process that is gone (it may exit at any time)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return 0


def _children() -> dict[int, list[int]]:
    """Every process's children, from /proc/*/stat (field 4 is the parent's pid)."""
    tree: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        # The command name may hold spaces and parentheses; the fields start after the last ')'.
        ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])
        tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def _cmdline(pid: int) -> bytes | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None


def tree_rss(root: int) -> tuple[int, int, int]:
    """(resident bytes of ``root``, of all its descendants together, number of processes).

    A child whose command line is its parent's is a fork that has not yet called exec (a
    subprocess being started): its resident pages are its parent's, shared, so it is not
    counted twice. The one exception is ``bisect``'s own: its command runs in a fork of the
    process started, which only waits (``process.survive_reference_crash``); that fork, the
    root's only child, is counted as the root, and the waiting parent's pages, shared with
    it, are not.
    """
    tree = _children()
    kids = tree.get(root, [])
    if len(kids) == 1 and _cmdline(kids[0]) == _cmdline(root):
        root = kids[0]
    below, count = 0, 1
    todo = [(pid, root) for pid in tree.get(root, [])]
    while todo:
        pid, parent = todo.pop()
        todo += [(child, pid) for child in tree.get(pid, [])]
        if _cmdline(pid) == _cmdline(parent):
            continue
        below += _rss(pid)
        count += 1
    return _rss(root), below, count


def measure(
    argv: Sequence[str],
    *,
    interval: float = 0.02,
    timeout: float | None = None,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    stdout: int | IO[bytes] | None = subprocess.DEVNULL,
    stderr: int | IO[bytes] | None = None,
) -> TreePeak:
    """Run ``argv`` to its end and return the peaks of its process tree's resident memory."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        list(argv), env=None if env is None else dict(env), cwd=cwd, stdout=stdout, stderr=stderr
    )
    peaks = [0, 0, 0, 0, 0]  # tree, main, children, samples, most processes
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            main, below, count = tree_rss(proc.pid)
            peaks[0] = max(peaks[0], main + below)
            peaks[1] = max(peaks[1], main)
            peaks[2] = max(peaks[2], below)
            peaks[3] += 1
            peaks[4] = max(peaks[4], count)
            done.wait(interval)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        rc = proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        done.set()
        thread.join()
    wall = time.perf_counter() - start
    return TreePeak(rc, wall, peaks[0], peaks[1], peaks[2], peaks[3], peaks[4])


def conv_net(blocks: int, size: int, *, seed: int = 0) -> onnx.ModelProto:
    """``blocks`` residual blocks on a 1x64xSIZExSIZE input: x + Conv1x1(Relu(DWConv3x3(x))).

    Node names: ``block{i}/dw``, ``block{i}/relu``, ``block{i}/pw``, ``block{i}/add``. Weights
    are scaled so that values stay of order one through many blocks.
    """
    rng = np.random.default_rng(seed)
    c = CHANNELS
    nodes, inits = [], []
    x = "input"
    for i in range(blocks):
        p = f"block{i}"
        dw = (rng.standard_normal((c, 1, 3, 3)) / 3.0).astype(np.float32)
        pw = (rng.standard_normal((c, c, 1, 1)) / (2.0 * np.sqrt(c))).astype(np.float32)
        inits += [
            numpy_helper.from_array(dw, f"{p}/dw.w"),
            numpy_helper.from_array(pw, f"{p}/pw.w"),
        ]
        nodes += [
            helper.make_node(
                "Conv", [x, f"{p}/dw.w"], [f"{p}/dw.out"], name=f"{p}/dw",
                group=c, kernel_shape=[3, 3], pads=[1, 1, 1, 1],
            ),
            helper.make_node("Relu", [f"{p}/dw.out"], [f"{p}/relu.out"], name=f"{p}/relu"),
            helper.make_node(
                "Conv", [f"{p}/relu.out", f"{p}/pw.w"], [f"{p}/pw.out"], name=f"{p}/pw",
                kernel_shape=[1, 1],
            ),
            helper.make_node("Add", [x, f"{p}/pw.out"], [f"{p}/add.out"], name=f"{p}/add"),
        ]  # fmt: skip
        x = f"{p}/add.out"
    shape = [1, c, size, size]
    graph = helper.make_graph(
        nodes,
        f"conv_net_{blocks}x{size}",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, shape)],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def intermediate_bytes(blocks: int, size: int) -> int:
    """Bytes of every tensor a ``conv_net(blocks, size)`` computes (4 per block)."""
    return 4 * blocks * CHANNELS * size * size * 4


def _main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--interval", type=float, default=0.02)
    p.add_argument("--build-conv", metavar="OUT", help="write conv_net(--blocks, --size) here")
    p.add_argument("--blocks", type=int, default=28)
    p.add_argument("--size", type=int, default=512)
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    if args.build_conv:
        onnx.save(conv_net(args.blocks, args.size), args.build_conv)
        mib = intermediate_bytes(args.blocks, args.size) / 2**20
        print(f"{args.build_conv}: {4 * args.blocks} nodes, {mib:.0f} MiB of intermediates")
        return 0
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("give a command after --")
    peak = measure(command, interval=args.interval, stdout=None)
    print(json.dumps(peak.__dict__), file=sys.stderr)
    return peak.returncode


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
