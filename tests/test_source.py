"""Source locations: the module path, class and file:line of the first divergence and the root
cause, from what torch's exporters leave in the model, in every report."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import onnx
import pytest
from onnx import helper

import onnx_bisect
from onnx_bisect.graph.source import SourceInfo, node_source
from tests.faulty import FaultyBackend

TRACE = (
    'File "/work/m.py", line 11, in forward\n'
    "    return s.head(s.blocks(x))\n"
    '  File "/venv/lib/python3.11/site-packages/torch/nn/modules/container.py", line 253, in '
    "forward\n"
    "    input = module(input)\n"
    '  File "/work/m.py", line 6, in forward\n'
    "    return s.act(s.fc(x)) + x\n"
    '  File "/venv/lib/python3.11/site-packages/torch/nn/modules/activation.py", line 816, in '
    "forward\n"
    "    return F.gelu(input, approximate=self.approximate)"
)


def test_the_dynamo_exporters_metadata_gives_module_class_and_the_users_line() -> None:
    node = helper.make_node("Gelu", ["a"], ["b"], name="node_gelu")
    for key, value in (
        ("pkg.torch.onnx.name_scopes", "['', 'blocks', 'blocks.0', 'blocks.0.act', 'gelu']"),
        (
            "pkg.torch.onnx.class_hierarchy",
            "['__main__.M', 'torch.nn.modules.container.Sequential', '__main__.Block', "
            "'torch.nn.modules.activation.GELU', 'aten.gelu.default']",
        ),
        ("pkg.torch.onnx.stack_trace", TRACE),
    ):
        node.metadata_props.add(key=key, value=value)
    src = node_source(node)
    # torch's own frames are how torch runs the module; the user's forward is line 6.
    assert src == SourceInfo(
        "blocks.0.act", "torch.nn.modules.activation.GELU", "/work/m.py", 6,
        "return s.act(s.fc(x)) + x",
    )  # fmt: skip
    assert src.describe() == "module blocks.0.act (GELU) at /work/m.py:6: return s.act(s.fc(x)) + x"


@pytest.mark.parametrize(
    ("name", "module"),
    [
        ("/blocks/blocks.0/act/Gelu", "blocks.0.act"),
        ("/model.22/dfl/conv/Conv", "model.22.dfl.conv"),
        ("/Add", None),
        ("Conv_12", None),
    ],
)
def test_a_torchscript_name_gives_the_module_path(name: str, module: str | None) -> None:
    src = node_source(helper.make_node("Relu", ["a"], ["b"], name=name))
    assert (src.module if src else None) == module


def _export(tmp_path: Path, *, dynamo: bool) -> Path:
    torch = pytest.importorskip("torch")

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)
            self.act = torch.nn.GELU()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.act(self.fc(x)) + x  # LINE: the GELU's source

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.Sequential(Block(), Block())
            self.head = torch.nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.blocks(x))

    torch.manual_seed(0)
    path = tmp_path / ("dynamo.onnx" if dynamo else "torchscript.onnx")
    args = (Model().eval(), (torch.randn(2, 8),), str(path))
    torch.onnx.export(*args, dynamo=dynamo, input_names=["x"], output_names=["y"])
    return path


def _gelu(path: Path) -> str:
    return next(n.name for n in onnx.load(path).graph.node if n.op_type == "Gelu")


def _line() -> int:
    lines, start = inspect.getsourcelines(_export)
    return start + next(i for i, text in enumerate(lines) if "# LINE:" in text)


@pytest.mark.parametrize("dynamo", [True, False], ids=["dynamo", "torchscript"])
def test_a_fault_in_a_gelu_names_its_module_in_every_report(
    tmp_path: Path, dynamo: bool
) -> None:
    path = _export(tmp_path, dynamo=dynamo)
    gelu = _gelu(path)
    result = onnx_bisect.bisect(path, ref="cpu", target=FaultyBackend(gelu))
    assert result.root_cause is not None and result.root_cause.nodes == (gelu,)
    out = tmp_path / "report"
    onnx_bisect.write_reports(result, out)
    source = json.loads((out / "report.json").read_text())["root_cause"]["source"]
    assert source["module"] == "blocks.0.act"
    if dynamo:
        assert (source["class"], source["file"], source["line"]) == (
            "torch.nn.modules.activation.GELU",
            __file__,
            _line(),
        )
        said = f"from module blocks.0.act (GELU) at {__file__}:{_line()}"
        assert said in result.summary()
        assert said in (out / "report.md").read_text()
    else:  # the node's name, /blocks/blocks.0/act/Gelu, already says as much
        assert source["file"] is None and source["line"] is None
        assert "from module" not in result.summary()


def test_a_model_without_metadata_has_no_source(tmp_path: Path) -> None:
    from tests.models import YOLO

    result = onnx_bisect.bisect(YOLO, ref="cpu", target=FaultyBackend("/down1/conv/Conv"))
    # A TorchScript-style name: the module path only.
    assert result.sources["/down1/conv/Conv"] == SourceInfo("down1.conv")
