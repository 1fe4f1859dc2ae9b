"""Recurrent layers: LSTM, GRU and RNN, as an explicit loop over time steps.

The input projection of every step is one matmul up front; only the recurrent part runs
per step. Where ONNX leaves details open (clip, input_forget, sequence_lens), the behaviour
is onnxruntime's: clip bounds every gate's pre-activation, input_forget makes the forget
gate ``1 - i``, and a batch entry past its length keeps its state and outputs zeros.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from onnx_bisect.backends.torch.context import OpContext
from onnx_bisect.backends.torch.ops.registry import register
from onnx_bisect.errors import BackendError

__all__: list[str] = []

Act = Callable[[torch.Tensor], torch.Tensor]
State = tuple[torch.Tensor, ...]  # (h,) or (h, c)
Step = Callable[[torch.Tensor, State], State]

# lower-case name -> (default alpha, default beta, fn(x, alpha, beta)); None: takes none
_ACTIVATIONS: dict[str, tuple[float | None, float | None, Callable[..., torch.Tensor]]] = {
    "relu": (None, None, lambda x, a, b: torch.relu(x)),
    "tanh": (None, None, lambda x, a, b: torch.tanh(x)),
    "sigmoid": (None, None, lambda x, a, b: torch.sigmoid(x)),
    "affine": (1.0, 0.0, lambda x, a, b: a * x + b),
    "leakyrelu": (0.01, None, lambda x, a, b: torch.where(x >= 0, x, a * x)),
    "thresholdedrelu": (1.0, None, lambda x, a, b: torch.where(x > a, x, torch.zeros_like(x))),
    "scaledtanh": (1.0, 1.0, lambda x, a, b: a * torch.tanh(b * x)),
    "hardsigmoid": (0.2, 0.5, lambda x, a, b: (a * x + b).clamp(0, 1)),
    "elu": (1.0, None, lambda x, a, b: torch.where(x >= 0, x, a * torch.expm1(x))),
    "softsign": (None, None, lambda x, a, b: x / (1 + x.abs())),
    "softplus": (None, None, lambda x, a, b: torch.nn.functional.softplus(x)),
}


def _bind(fn: Callable[..., torch.Tensor], alpha: float | None, beta: float | None) -> Act:
    def act(x: torch.Tensor) -> torch.Tensor:
        return fn(x, alpha, beta)

    return act


def _activations(attrs: dict[str, Any], defaults: list[str], dirs: int) -> list[Act]:
    """The activation functions, ``len(defaults)`` per direction.

    alpha and beta lists are consumed in order, by the functions that take them only
    (as onnxruntime reads them); a function past the end of a list gets its default."""
    names = [str(n) for n in attrs.get("activations", defaults * dirs)]
    if len(names) != len(defaults) * dirs:
        raise BackendError(f"{len(names)} activations given, {len(defaults) * dirs} expected")
    alphas: Iterator[float] = iter(float(a) for a in attrs.get("activation_alpha", []))
    betas: Iterator[float] = iter(float(b) for b in attrs.get("activation_beta", []))
    out: list[Act] = []
    for name in names:
        entry = _ACTIVATIONS.get(name.lower())
        if entry is None:
            raise BackendError(f"the recurrent activation {name!r} is not supported")
        alpha0, beta0, fn = entry
        a = next(alphas, alpha0) if alpha0 is not None else None
        b = next(betas, beta0) if beta0 is not None else None
        out.append(_bind(fn, a, b))
    return out


@dataclass(frozen=True)
class _Layer:
    """The parts every recurrent op shares, with the time axis first (layout 0)."""

    x: torch.Tensor  # [T, B, I]
    w: torch.Tensor  # [D, G*H, I]
    r: torch.Tensor  # [D, G*H, H]
    wb: torch.Tensor  # [D, G*H] input bias
    rb: torch.Tensor  # [D, G*H] recurrent bias
    lens: torch.Tensor | None  # [B]
    initial: list[torch.Tensor]  # each [D, B, H]
    directions: list[bool]  # reverse, per direction
    layout: int
    clip: float | None


def _layer(
    ctx: OpContext, x: list[torch.Tensor | None], attrs: dict[str, Any], gates: int
) -> _Layer:
    xs, w, r = x[0], x[1], x[2]
    assert xs is not None and w is not None and r is not None
    layout = int(attrs.get("layout", 0))
    if layout:
        xs = xs.transpose(0, 1)
    direction = str(attrs.get("direction", "forward"))
    reverse = {"forward": [False], "reverse": [True], "bidirectional": [False, True]}
    if direction not in reverse:
        raise BackendError(f"recurrent direction {direction!r} is not supported")
    dirs, hidden, batch = w.shape[0], r.shape[-1], xs.shape[1]
    b = x[3] if len(x) > 3 else None
    if b is None:
        b = torch.zeros(dirs, 2 * gates * hidden, dtype=xs.dtype, device=ctx.device)
    lens = x[4] if len(x) > 4 else None
    initial = []
    for i in (5, 6) if gates == 4 else (5,):
        state = x[i] if len(x) > i else None
        if state is None:
            state = torch.zeros(dirs, batch, hidden, dtype=xs.dtype, device=ctx.device)
        elif layout:
            state = state.transpose(0, 1)
        initial.append(state)
    clip = attrs.get("clip")
    wb, rb = b[:, : gates * hidden], b[:, gates * hidden :]
    return _Layer(xs, w, r, wb, rb, lens, initial, reverse[direction], layout,
                  None if clip is None else float(clip))  # fmt: skip


def _clipper(clip: float | None) -> Act:
    if clip is None:
        return lambda t: t
    return lambda t: t.clamp(-clip, clip)


def _scan(
    proj: torch.Tensor, state: State, step: Step, lens: torch.Tensor | None, reverse: bool
) -> tuple[torch.Tensor, State]:
    """Runs ``step`` over the time axis; returns every step's h and the final state."""
    steps = proj.shape[0]
    ys: list[torch.Tensor] = [state[0]] * steps
    for t in range(steps - 1, -1, -1) if reverse else range(steps):
        new = step(proj[t], state)
        if lens is not None:
            # Past its length an entry keeps its state (a reverse pass starts at its end).
            valid = (lens > t)[:, None]
            new = tuple(torch.where(valid, n, o) for n, o in zip(new, state, strict=True))
            ys[t] = torch.where(valid, new[0], torch.zeros_like(new[0]))
        else:
            ys[t] = new[0]
        state = new
    if not ys:
        return proj.new_zeros(0, *state[0].shape), state
    return torch.stack(ys), state


def _run(layer: _Layer, steps: list[Step], proj_bias: torch.Tensor) -> list[torch.Tensor]:
    """Y, then each final state; laid out per ``layout``."""
    lens = None if layer.lens is None else layer.lens.to(device=layer.x.device, dtype=torch.int64)
    ys, finals = [], []
    for d, reverse in enumerate(layer.directions):
        proj = layer.x @ layer.w[d].transpose(0, 1) + proj_bias[d]
        state = tuple(s[d] for s in layer.initial)
        y, final = _scan(proj, state, steps[d], lens, reverse)
        ys.append(y)
        finals.append(final)
    y_all = torch.stack(ys, dim=1)  # [T, D, B, H]
    states = [torch.stack([f[k] for f in finals]) for k in range(len(layer.initial))]
    if layer.layout:
        return [y_all.permute(2, 0, 1, 3), *[s.transpose(0, 1) for s in states]]
    return [y_all, *states]


def _lstm_step(
    r: torch.Tensor, p: torch.Tensor | None, acts: list[Act], clip: Act, input_forget: bool
) -> Step:
    f, g, h = acts
    rt = r.transpose(0, 1)
    pi, po, pf = (None, None, None) if p is None else p.chunk(3)

    def step(proj: torch.Tensor, state: State) -> State:
        h_prev, c_prev = state
        i, o, fg, c = (proj + h_prev @ rt).chunk(4, dim=-1)
        if pi is not None and pf is not None:
            i, fg = i + pi * c_prev, fg + pf * c_prev
        i = f(clip(i))
        fg = 1 - i if input_forget else f(clip(fg))
        c_new = fg * c_prev + i * g(clip(c))
        if po is not None:
            o = o + po * c_new
        return f(clip(o)) * h(c_new), c_new

    return step


@register("LSTM", since=7, until=22)
def lstm(ctx: OpContext, x: list[torch.Tensor | None], attrs: dict[str, Any]) -> list[torch.Tensor]:
    layer = _layer(ctx, x, attrs, gates=4)
    dirs = len(layer.directions)
    acts = _activations(attrs, ["Sigmoid", "Tanh", "Tanh"], dirs)
    peep = x[7] if len(x) > 7 else None
    clip = _clipper(layer.clip)
    forget = bool(attrs.get("input_forget", 0))
    steps = [
        _lstm_step(
            layer.r[d], None if peep is None else peep[d], acts[3 * d : 3 * d + 3], clip, forget
        )
        for d in range(dirs)
    ]
    return _run(layer, steps, layer.wb + layer.rb)


def _gru_step(r: torch.Tensor, rb: torch.Tensor, acts: list[Act], clip: Act, linear: bool) -> Step:
    f, g = acts
    hidden = r.shape[-1]
    rzr, rh = r[: 2 * hidden].transpose(0, 1), r[2 * hidden :].transpose(0, 1)
    rbzr, rbh = rb[: 2 * hidden], rb[2 * hidden :]

    def step(proj: torch.Tensor, state: State) -> State:
        (h_prev,) = state
        pz, pr, ph = proj.chunk(3, dim=-1)
        hz, hr = (h_prev @ rzr + rbzr).chunk(2, dim=-1)
        z, r_gate = f(clip(pz + hz)), f(clip(pr + hr))
        if linear:
            cand = g(clip(ph + r_gate * (h_prev @ rh + rbh)))
        else:
            cand = g(clip(ph + (r_gate * h_prev) @ rh + rbh))
        return ((1 - z) * cand + z * h_prev,)

    return step


@register("GRU", since=7, until=22)
def gru(ctx: OpContext, x: list[torch.Tensor | None], attrs: dict[str, Any]) -> list[torch.Tensor]:
    layer = _layer(ctx, x, attrs, gates=3)
    dirs = len(layer.directions)
    acts = _activations(attrs, ["Sigmoid", "Tanh"], dirs)
    clip = _clipper(layer.clip)
    linear = bool(attrs.get("linear_before_reset", 0))
    steps = [
        _gru_step(layer.r[d], layer.rb[d], acts[2 * d : 2 * d + 2], clip, linear)
        for d in range(dirs)
    ]
    return _run(layer, steps, layer.wb)


def _rnn_step(r: torch.Tensor, act: Act, clip: Act) -> Step:
    rt = r.transpose(0, 1)

    def step(proj: torch.Tensor, state: State) -> State:
        return (act(clip(proj + state[0] @ rt)),)

    return step


@register("RNN", since=7, until=22)
def rnn(ctx: OpContext, x: list[torch.Tensor | None], attrs: dict[str, Any]) -> list[torch.Tensor]:
    layer = _layer(ctx, x, attrs, gates=1)
    dirs = len(layer.directions)
    acts = _activations(attrs, ["Tanh"], dirs)
    clip = _clipper(layer.clip)
    steps = [_rnn_step(layer.r[d], acts[d], clip) for d in range(dirs)]
    return _run(layer, steps, layer.wb + layer.rb)
