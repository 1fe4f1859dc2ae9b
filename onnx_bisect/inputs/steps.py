"""How a multi-step model feeds itself (``--steps``): which outputs become which inputs of the
next step, the greedy token, a growing attention mask and positions, and per-step chunks.

Pure: names and arrays in, names and arrays out. Hugging Face and Optimum exports are
recognized by their names (``present.*`` or ``present_key_values.*`` -> ``past_key_values.*``,
``logits`` -> ``input_ids``, ``attention_mask``, ``position_ids``); any other model is wired by
``OUT=IN`` rules whose ``*`` stands for the same text on both sides.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from onnx_bisect.errors import InputError
from onnx_bisect.inputs.shapes import default_dim
from onnx_bisect.inputs.signature import InputSpec

__all__ = [
    "Wiring",
    "detect_wiring",
    "first_feeds",
    "greedy_token",
    "next_feeds",
    "parse_state_rule",
    "split_chunks",
]

Feeds = dict[str, npt.NDArray[np.generic]]

# Hugging Face / Optimum: what an output is called, and the input of the next step it feeds.
_PRESENT = ("present_key_values.", "present.")
_PAST = ("past_key_values.", "past.")
TOKEN_OUTPUT, TOKEN_INPUT = "logits", "input_ids"
MASK_INPUT, POSITIONS_INPUT = "attention_mask", "position_ids"


@dataclass(frozen=True)
class Wiring:
    """What feeds each step's inputs from the step before (the rest keep step 0's values)."""

    state: tuple[tuple[str, str], ...]  # (output, input) pairs carried over as they are
    token: tuple[str, str] | None = None  # (logits output, token input): the greedy token
    mask: str | None = None  # an attention mask grown by the new tokens
    positions: str | None = None  # positions advanced by the new tokens
    chunked: tuple[str, ...] = ()  # inputs fed chunk by chunk (``--chunks``)

    def lines(self) -> tuple[str, ...]:
        out = [f"{o} -> {i}" for o, i in self.state]
        if self.token:
            out.append(f"argmax of {self.token[0]}'s last position -> {self.token[1]}")
        if self.mask:
            out.append(f"{self.mask} grown by one per new token")
        if self.positions:
            out.append(f"{self.positions} advanced by the new tokens")
        out += [f"{name}: chunk k at step k" for name in self.chunked]
        return tuple(out)

    @property
    def fed(self) -> set[str]:
        """Inputs a step gets from the step before or from the chunks."""
        tail = (self.token[1],) if self.token else ()
        grown = tuple(n for n in (self.mask, self.positions) if n)
        return {*(i for _, i in self.state), *tail, *grown, *self.chunked}


def parse_state_rule(text: str) -> tuple[str, str]:
    """``OUT=IN``: an output name (or glob) and the input it feeds next step."""
    out, sep, inp = text.partition("=")
    if not sep or not out.strip() or not inp.strip():
        raise InputError(
            f"state {text!r}: expected OUT=IN, e.g. 'present.*=past_key_values.*' or "
            "'stateN=state'",
            option="state",
        )
    out, inp = out.strip(), inp.strip()
    if out.count("*") != inp.count("*"):
        raise InputError(
            f"state {text!r}: both sides need the same number of '*' (each stands for the same "
            "text on both)",
            option="state",
        )
    return out, inp


def _match_rule(rule: tuple[str, str], outputs: Sequence[str]) -> list[tuple[str, str]]:
    pattern, target = rule
    regex = re.compile("^" + "(.*?)".join(re.escape(p) for p in pattern.split("*")) + "$")
    pairs = []
    for name in outputs:
        m = regex.match(name)
        if m is None:
            continue
        parts = target.split("*")
        filled = parts[0] + "".join(g + p for g, p in zip(m.groups(), parts[1:], strict=True))
        pairs.append((name, filled))
    return pairs


def _hf_state(inputs: set[str], outputs: Sequence[str]) -> list[tuple[str, str]]:
    pairs = []
    for name in outputs:
        rest = next((name[len(p) :] for p in _PRESENT if name.startswith(p)), None)
        if rest is None:
            continue
        fed = next((p + rest for p in _PAST if p + rest in inputs), None)
        if fed is not None:
            pairs.append((name, fed))
    return pairs


def detect_wiring(
    specs: Sequence[InputSpec],
    outputs: Sequence[str],
    rules: Sequence[str] = (),
    chunked: Sequence[str] = (),
) -> Wiring:
    """The wiring of a model: ``rules`` (``OUT=IN``) first, then Hugging Face names for the
    inputs no rule feeds. A rule that matches nothing, or names no input, is an error: a
    typo would silently leave a state at its first value."""
    inputs = {s.name for s in specs}
    state: dict[str, str] = {}  # input -> output
    for text in rules:
        rule = parse_state_rule(text)
        pairs = _match_rule(rule, outputs)
        if not pairs:
            raise InputError(
                f"state {text!r}: no output matches {rule[0]!r} (outputs: {', '.join(outputs)})",
                option="state",
            )
        for out, inp in pairs:
            if inp not in inputs:
                raise InputError(
                    f"state {text!r}: output {out!r} would feed {inp!r}, which is not an input "
                    f"(inputs: {', '.join(s.name for s in specs)})",
                    option="state",
                )
            state[inp] = out
    for out, inp in _hf_state(inputs, outputs):
        state.setdefault(inp, out)
    unknown = sorted(set(chunked) - inputs)
    if unknown:
        raise InputError(
            f"chunks: {', '.join(unknown)} is not an input of the model "
            f"(inputs: {', '.join(s.name for s in specs)})",
            option="chunks",
        )
    taken = set(state) | set(chunked)
    token = None
    if TOKEN_OUTPUT in outputs and TOKEN_INPUT in inputs and TOKEN_INPUT not in taken:
        token = (TOKEN_OUTPUT, TOKEN_INPUT)
    grows = token is not None
    mask = MASK_INPUT if grows and MASK_INPUT in inputs and MASK_INPUT not in taken else None
    positions = (
        POSITIONS_INPUT
        if grows and POSITIONS_INPUT in inputs and POSITIONS_INPUT not in taken
        else None
    )
    carried = tuple((out, inp) for inp, out in state.items())
    wiring = Wiring(carried, token, mask, positions, tuple(chunked))
    if not wiring.fed:
        raise InputError(
            "steps: nothing feeds one step from the one before: no output is named like a "
            "Hugging Face cache (present.* -> past_key_values.*) or logits -> input_ids; wire "
            "them with --state OUT=IN (globs allowed) or give per-step inputs with --chunks",
            option="steps",
        )
    return wiring


def split_chunks(arrays: Mapping[str, npt.NDArray[np.generic]], steps: int) -> list[Feeds]:
    """Per-step inputs from arrays split along their leading axis: step k gets ``a[k]``."""
    short = {name: a.shape[0] for name, a in arrays.items() if a.ndim == 0 or a.shape[0] < steps}
    if short:
        said = ", ".join(f"{n} has {k}" for n, k in short.items())
        raise InputError(
            f"chunks: {steps} steps need {steps} chunks along axis 0 of each array; {said}",
            option="chunks",
        )
    return [{name: np.ascontiguousarray(a[k]) for name, a in arrays.items()} for k in range(steps)]


def greedy_token(logits: npt.NDArray[np.generic]) -> npt.NDArray[np.int64]:
    """The argmax of the last position, per batch row: shape (batch, 1)."""
    x = np.asarray(logits)
    last = x[:, -1, :] if x.ndim == 3 else x.reshape(x.shape[0], -1)
    token: npt.NDArray[np.int64] = np.argmax(last, axis=-1).astype(np.int64).reshape(-1, 1)
    return token


def next_feeds(
    wiring: Wiring,
    specs: Sequence[InputSpec],
    feeds: Mapping[str, npt.NDArray[np.generic]],
    outputs: Mapping[str, npt.NDArray[np.generic]],
    chunk: Mapping[str, npt.NDArray[np.generic]] | None = None,
) -> Feeds:
    """The next step's inputs: this step's ``feeds`` with the wired ones replaced from this
    step's ``outputs`` (in the input's dtype) and the next ``chunk``."""
    dtypes = {s.name: s.dtype for s in specs}
    out: Feeds = dict(feeds)
    for name, inp in wiring.state:
        out[inp] = np.asarray(outputs[name]).astype(dtypes[inp], copy=False)
    if wiring.token is not None:
        logits, ids = wiring.token
        token = greedy_token(outputs[logits]).astype(dtypes[ids])
        out[ids] = token
        new = token.shape[1]
        if wiring.mask is not None:
            mask = np.asarray(feeds[wiring.mask])
            grown = np.ones((mask.shape[0], new), dtype=mask.dtype)
            out[wiring.mask] = np.concatenate([mask, grown], axis=1)
        if wiring.positions is not None:
            pos = np.asarray(feeds[wiring.positions])
            last = pos[:, -1:] if pos.size else np.full((pos.shape[0], 1), -1, pos.dtype)
            out[wiring.positions] = last + np.arange(1, new + 1, dtype=pos.dtype)
    for name, value in (chunk or {}).items():
        out[name] = np.asarray(value).astype(dtypes[name], copy=False)
    return out


def first_feeds(
    wiring: Wiring,
    specs: Sequence[InputSpec],
    generated: Mapping[str, npt.NDArray[np.generic]],
    shapes: Mapping[str, Sequence[int]] | None,
    chunk: Mapping[str, npt.NDArray[np.generic]] | None,
) -> Feeds:
    """Step 0's inputs when none are given: ``generated`` for the inputs nothing feeds, an
    empty state (a dynamic past length of 0, batch 1) for the carried ones unless ``shapes``
    gives them, a mask of ones and positions from 0 over the prompt, and chunk 0."""
    shapes = shapes or {}
    out: Feeds = dict(generated)
    for spec in specs:
        if spec.name in {i for _, i in wiring.state}:
            dims = shapes.get(spec.name) or tuple(
                _empty_dim(i, d) for i, d in enumerate(spec.dims)
            )
            out[spec.name] = np.zeros(tuple(dims), dtype=spec.dtype)
    if wiring.token is not None:
        ids = out[wiring.token[1]]
        batch, prompt = ids.shape[0], ids.shape[-1]
        past = _past_length(wiring, out)
        if wiring.mask is not None and wiring.mask not in shapes:
            dtype = next(s.dtype for s in specs if s.name == wiring.mask)
            out[wiring.mask] = np.ones((batch, past + prompt), dtype=dtype)
        if wiring.positions is not None and wiring.positions not in shapes:
            dtype = next(s.dtype for s in specs if s.name == wiring.positions)
            row = np.arange(past, past + prompt, dtype=dtype)
            out[wiring.positions] = np.tile(row, (batch, 1))
    for name, value in (chunk or {}).items():
        dtype = next(s.dtype for s in specs if s.name == name)
        out[name] = np.asarray(value).astype(dtype, copy=False)
    return out


def _empty_dim(index: int, dim: int | str | None) -> int:
    """A carried state's dim at step 0: fixed dims as declared, a batch 1, any other dynamic
    dim (the past length) 0."""
    size = default_dim(index, dim)
    return size if size is not None else 0


def _past_length(wiring: Wiring, feeds: Mapping[str, npt.NDArray[np.generic]]) -> int:
    """The past length of a KV cache at step 0: its sequence axis, the one that is 0 when
    empty (axis -2 of ``[batch, heads, past, head_dim]``)."""
    for _, inp in wiring.state:
        a = feeds.get(inp)
        if a is not None and a.ndim == 4:
            return int(a.shape[-2])
    return 0
