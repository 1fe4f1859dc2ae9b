"""TfIdfVectorizer over integer tokens: n-gram counts (with skips) into a fixed vocabulary,
weighted as TF, IDF or TF-IDF. Counting is data-dependent lookup, so it runs in Python on
the host; the result is one small float tensor per batch."""

from __future__ import annotations

from typing import Any

import torch

from onnx_bisect.backends.torch.context import OpContext
from onnx_bisect.backends.torch.ops.registry import register
from onnx_bisect.backends.torch.ops.shape import need
from onnx_bisect.errors import BackendError

__all__: list[str] = []

Inputs = list[torch.Tensor | None]


def _vocabulary(attrs: dict[str, Any]) -> dict[tuple[int, ...], int]:
    """Each pooled n-gram and its position in the pool (``ngram_counts[i]`` is where the
    (i+1)-grams start)."""
    pool = [int(v) for v in attrs.get("pool_int64s", [])]
    if not pool:
        raise BackendError("TfIdfVectorizer over strings is not supported by the torch backend")
    starts = [int(c) for c in attrs["ngram_counts"]] + [len(pool)]
    out: dict[tuple[int, ...], int] = {}
    position = 0
    for size, (begin, end) in enumerate(zip(starts, starts[1:], strict=False), start=1):
        for at in range(begin, end, size):
            out[tuple(pool[at : at + size])] = position
            position += 1
    return out


def _counts(
    row: list[int], vocab: dict[tuple[int, ...], int], attrs: dict[str, Any]
) -> dict[int, int]:
    low, high = int(attrs["min_gram_length"]), int(attrs["max_gram_length"])
    skips = int(attrs["max_skip_count"])
    counts: dict[int, int] = {}
    for start in range(len(row)):
        for n in range(low, high + 1):
            # A unigram has no gaps to skip: it is counted once per position.
            for skip in range(skips + 1 if n > 1 else 1):
                last = start + (n - 1) * (skip + 1)
                if last >= len(row):
                    break
                gram = tuple(row[start : last + 1 : skip + 1])
                if gram in vocab:
                    counts[vocab[gram]] = counts.get(vocab[gram], 0) + 1
    return counts


@register("TfIdfVectorizer", since=9)
def tfidf_vectorizer(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> torch.Tensor:
    data = need(x, 0)
    vocab = _vocabulary(attrs)
    indexes = [int(i) for i in attrs["ngram_indexes"]]
    weights = [float(w) for w in attrs.get("weights", [])] or [1.0] * len(indexes)
    mode = str(attrs.get("mode", "TF"))
    rows = data.reshape(1, -1) if data.dim() == 1 else data.reshape(data.shape[0], -1)
    out = torch.zeros(rows.shape[0], max(indexes) + 1, dtype=torch.float64)
    for r, row in enumerate(rows.tolist()):
        for position, count in _counts(row, vocab, attrs).items():
            slot = indexes[position]
            tf = 1.0 if mode == "IDF" else float(count)
            out[r, slot] = tf * (weights[position] if mode != "TF" else 1.0)
    out = out.to(ctx.dtype(1)).to(ctx.device)
    return out[0] if data.dim() == 1 else out
