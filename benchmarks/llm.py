"""A Llama-shaped causal LM for ``bench_scale``'s LLM rows, built with ``transformers`` from a
config written here (random weights, nothing downloaded) and exported by torch.onnx's
TorchScript exporter, as in issue 28's 64-layer model.

    python benchmarks/llm.py LAYERS OUT.onnx

Needs torch and transformers (the dev extra). Per layer: RMSNorm, grouped-query attention
(8 heads, 4 key/value heads, rotary embeddings), RMSNorm, a SwiGLU MLP; about 115 nodes a layer
with the exporter's Constants. Activations are ``[1, SEQ, HIDDEN]`` float32, 24,576 values, the
size of the tensors whose comparison took 96% of issue 28's scan.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import onnx

__all__ = ["HIDDEN", "SEQ", "down_proj", "llama"]

HIDDEN, INTERMEDIATE, VOCAB, SEQ = 256, 688, 2048, 96
OPSET = 18


def llama(
    layers: int,
    path: Path,
    seed: int = 0,
    *,
    hidden: int = HIDDEN,
    intermediate: int = INTERMEDIATE,
) -> Path:
    """Writes the model of ``layers`` decoder layers to ``path`` (input ``input_ids``
    ``[1, SEQ]`` int64, output ``logits``) unless it is there already. Past 2 GB of weights
    the exporter writes them in a file per tensor beside the model."""
    if path.is_file():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2 * SEQ,
        use_cache=False,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()

    class Logits(torch.nn.Module):
        """input_ids -> logits. An explicit all-ones attention mask: without one, transformers
        looks for packed sequences with aten::diff, which the exporter cannot write."""

        def __init__(self) -> None:
            super().__init__()
            self.lm = model

        def forward(self, input_ids: Any) -> Any:
            mask = torch.ones_like(input_ids)
            return self.lm(input_ids=input_ids, attention_mask=mask, use_cache=False).logits

    ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(seed))
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            Logits(),
            (ids,),
            str(path),
            input_names=["input_ids"],
            output_names=["logits"],
            opset_version=OPSET,
            dynamo=False,
        )
    return path


def down_proj(model: onnx.ModelProto, layer: int) -> str:
    """The MatMul of layer ``layer``'s MLP down projection (issue 28 planted its fault there)."""
    key = f"layers.{layer}/mlp/down_proj/MatMul"
    return next(n.name for n in model.graph.node if n.op_type == "MatMul" and key in n.name)


if __name__ == "__main__":
    written = llama(int(sys.argv[1]), Path(sys.argv[2]))
    loaded = onnx.load(str(written))
    print(f"{written}: {len(loaded.graph.node)} nodes")
