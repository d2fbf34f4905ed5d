"""Megatron-Core 0.16.1's Muon (`--optimizer dist_muon`) as one optax transformation: `muon(...)`.

Megatron chains `TensorParallelMuon` (for every param that is 2-D and not the embedding or the output
layer) with AdamW (for the rest), and steps each param on its own (docs/megatron.md, "Muon"). Per
param, with its group's `lr = lr * lr_mult` and `wd = weight_decay * wd_mult` (jzero's param groups,
`groups.py`), in fp32:

  Muon:   p <- p - lr * wd * p                      decoupled weight decay, first
          m <- m + (1 - momentum) * (g - m)          torch's lerp
          d = m, or g + momentum * (m - g) with Nesterov
          p <- p - lr * NS(d) * scale                scale: `SCALE_MODES`, times extra_scale_factor
  AdamW:  p <- p - lr * wd * p
          mu <- mu + (1 - b1) * (g - mu);  nu <- b2 * nu + (1 - b2) * g^2
          p <- p - lr / (1 - b1^t) * mu / (sqrt(nu) / sqrt(1 - b2^t) + eps)      torch's AdamW

NS is Megatron's quintic Newton-Schulz (`newton_schulz`). Its iterations run in bf16 by default
(`--muon-fp32-matmul-prec medium`): two runs whose momenta differ in an fp32 ulp agree bit for bit
almost always, but where an element of the normalised momentum sits on a bf16 rounding boundary the
whole update moves by ~2 bf16 ulps (docs/megatron.md, "Muon"). `ns_dtype=jnp.float32` is Megatron's
`high` precision, smooth to fp32 rounding.

Rounding: on CPU, Megatron's update is torch's, whose `lerp_`, `addcmul_` and `addmm` epilogue each
round a*b + c once (a fused multiply-add). XLA contracts a*b + c the same way at its default
optimization level (not at LLVM -O0), and `_rounded` marks the one product it must not contract; so
fed Megatron's grads, this reproduces its Muon updates and optimizer state bit for bit
(tests/zero/common/test_muon.py), and its params to rounding (optax adds one update; torch adds
the weight decay and the step in turn).

The state is per param, laid out like the params (ZeRO shards it like Adam's moments): nothing
couples two params. Newton-Schulz needs the whole matrix, so the spec path runs it (XLA gathers a
sharded momentum where it must); the flat path, which steps slices of flat buffers, refuses it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jzero.errors import ConfigError
from jzero.zero.common.groups import multipliers
from jzero.zero.common.strategies import path_name

PyTree = Any

# Megatron-Core 0.16.1's quintic Newton-Schulz coefficients (a, b, c), one triple per iteration
# (cycled past 5 iterations).
QUINTIC = (
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
)

# Megatron's `get_muon_scale_factor(size_out, size_in, mode)`. `muon` reads a matrix as JAX's [in, out]
# (x @ W; `MatrixView.rows` the input side), as jzero's kernels are; a torch-layout [out, in] param gets
# out and in swapped, which only `spectral` does not mind.
SCALE_MODES: dict[str, Callable[[int, int], float]] = {
    "spectral": lambda out, in_: math.sqrt(max(out, in_)),
    "shape_scaling": lambda out, in_: math.sqrt(max(1.0, out / in_)),
    "unit_rms_norm": lambda out, in_: math.sqrt(out / in_),
}

# Megatron sends the params it flags `is_embedding_or_output_parameter` (the word embeddings and the
# output layer) to AdamW. By name: jzero's GPT's `tok_emb` and `head` (a learned `pos_emb` is not
# flagged in Megatron either, so it is Muon), and the usual names of other models.
EMBEDDING_OR_OUTPUT = r"(^|/)(tok_emb|wte|embed|embedding|embed_tokens|word_embeddings|head|lm_head|output_layer)(/|$)"


def newton_schulz(x: jax.Array, *, steps: int = 5, dtype=jnp.bfloat16, eps: float = 1e-7) -> jax.Array:
    """Megatron's quintic Newton-Schulz orthogonalisation of the last two dims of `x` [..., m, n].

    Leading dims are batch dims (a stacked [L, m, n] param: one NS per layer). A tall matrix is
    transposed first; X = x / max(||x||_F, eps) in fp32, rounded to `dtype`; then per iteration
    A = X X^T, B = b A + c A A, X = a X + B X, each of A, B, X one fp32 GEMM whose fp32 epilogue is
    rounded to `dtype` once (how torch's bf16 matmul and addmm round on CPU). Returns fp32 [..., m, n],
    sharded as XLA lays out `x`.
    """
    if steps < 1:
        raise ConfigError(f"newton_schulz: steps={steps} must be >= 1")
    f32 = jnp.float32

    def mm(a, b):
        return jnp.matmul(a, b, preferred_element_type=f32, precision=jax.lax.Precision.HIGHEST)

    x = jnp.asarray(x, f32)
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = jnp.swapaxes(x, -1, -2)
    norm = jnp.sqrt(jnp.sum(jnp.square(x), axis=(-2, -1), keepdims=True))
    X = (x / jnp.maximum(norm, eps)).astype(dtype)
    for i in range(steps):
        a, b, c = QUINTIC[i % len(QUINTIC)]
        A = mm(X, jnp.swapaxes(X, -1, -2)).astype(dtype)
        # torch's addmm(C, P, Q, beta, alpha) epilogue on CPU: fma(beta, C, round(alpha * (P Q))); XLA
        # contracts `b * A + ...` into that fma, and `_rounded` keeps it from contracting `c * AA` instead
        # (which flips 2 of the 45 bf16 updates of the Megatron fixture, docs/megatron.md "Muon").
        B = (b * A.astype(f32) + _rounded(c * mm(A, A))).astype(dtype)
        X = (a * X.astype(f32) + mm(B, X)).astype(dtype)
    X = X.astype(f32)
    return jnp.swapaxes(X, -1, -2) if tall else X


def _rounded(x: jax.Array) -> jax.Array:
    """x, its value rounded here: `copysign(x, x)` is x, but a bit operation that XLA cannot contract
    into a following add as a fused multiply-add."""
    return jnp.copysign(x, x)


def scale_factor(shape: tuple[int, ...], scale_mode: str = "spectral", extra_scale_factor: float = 1.0) -> float:
    """Megatron's scale of the orthogonalised update for a matrix of `shape` [in, out] (its last two dims)."""
    return SCALE_MODES[scale_mode](shape[-1], shape[-2]) * extra_scale_factor


class MatrixView(NamedTuple):
    """How a param (per layer) is the matrix, or matrices, Megatron orthogonalises.

    rows: its leading per-layer dims that are the matrix's rows (the input side; the rest are its columns):
      1 for a kernel [D, F], 2 for an attention output [H, K, D] (Megatron's `linear_proj` [D, H*K]).
    split_axis, split_sizes: a per-layer dim along which the param holds several matrices, each
      orthogonalised on its own (Megatron's `--muon-split-qkv`, its default: a fused QKV kernel
      [D, R + 2, G, K] is q [D, R*G*K], k and v [D, G*K]); None: one matrix.

    Newton-Schulz is the same up to a permutation of rows or columns, so the order of the dims folded into
    one side does not matter (jzero's q is (R, G, K), Megatron's (G, R, K)).
    """

    rows: int = 1
    split_axis: int | None = None
    split_sizes: tuple[int, ...] = ()


class MuonState(NamedTuple):
    """count: steps taken (int32 scalar); momentum: per param its Muon momentum buffer or AdamW's
    exp_avg, fp32 like the param; exp_avg_sq: per AdamW param its exp_avg_sq, `optax.MaskedNode()`
    for a Muon param."""

    count: jax.Array
    momentum: PyTree
    exp_avg_sq: PyTree


def muon_params(
    params: PyTree, is_muon: PyTree | Callable | None = None, layer_dims: PyTree | None = None,
    matrices: PyTree | None = None,
) -> PyTree:  # fmt: skip
    """Per param whether Muon steps it (else AdamW): `is_muon` as a tree of bools or a `(path, param) ->
    bool`, else Megatron's rule: a param with a view in `matrices` (default: every param 2-D per layer,
    one matrix) that is not the embedding or output layer. ConfigError for a Muon param without a view.

    `params` may hold `optax.MaskedNode()`s (as `optax.masked` and the owned layout hand a transformation
    its params: docs/owned.md); they stay MaskedNodes, and the other trees are read for the rest."""
    leaves, treedef = jax.tree.flatten(params, is_leaf=_masked)
    views = _views(params, is_muon, layer_dims, matrices)
    return treedef.unflatten([p if _masked(p) else v is not None for p, v in zip(leaves, views)])


def _masked(x) -> bool:
    return isinstance(x, optax.MaskedNode)


def _views(params, is_muon, layer_dims, matrices) -> list[tuple[MatrixView, int] | None]:
    """Per leaf of `params` (MaskedNodes as leaves): (its MatrixView, its layer dims) if Muon steps it, else None."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params, is_leaf=_masked)
    dims = [0] * len(leaves) if layer_dims is None else treedef.flatten_up_to(layer_dims)
    chosen = None if is_muon is None or callable(is_muon) else treedef.flatten_up_to(is_muon)
    views = None if matrices is None else treedef.flatten_up_to(matrices)

    def one(k, path, p):
        if _masked(p):
            return None
        view = views[k] if views is not None else MatrixView() if len(p.shape) - dims[k] == 2 else None
        if is_muon is None:
            muon = view is not None and re.search(EMBEDDING_OR_OUTPUT, path_name(path)) is None
        else:
            muon = bool(is_muon(path, p)) if callable(is_muon) else bool(chosen[k])
        if muon and view is None:
            raise ConfigError(
                f"muon: param {path_name(path)} {tuple(p.shape)} with {dims[k]} stacked layer dims is not a matrix "
                "per layer; Newton-Schulz needs 2-D (leave it to AdamW, or give its MatrixView in matrices=)"
            )
        return (view, dims[k]) if muon else None

    return [one(k, path, p) for k, (path, p) in enumerate(leaves)]


def orthogonalize(d: jax.Array, view: MatrixView, layer_dims: int, **ns) -> jax.Array:
    """NS(d) x its scale, per layer and per matrix of `view` (`muon`'s update direction; `ns`:
    `newton_schulz`'s and `scale_factor`'s keywords)."""
    scale_mode, extra = ns.pop("scale_mode"), ns.pop("extra_scale_factor")
    lead = d.shape[:layer_dims]
    parts = [d]
    if view.split_axis is not None:
        cuts = [sum(view.split_sizes[:i]) for i in range(1, len(view.split_sizes))]
        parts = jnp.split(d, cuts, axis=layer_dims + view.split_axis)
    out = []
    for x in parts:
        per = x.shape[layer_dims:]
        rows, cols = math.prod(per[: view.rows]), math.prod(per[view.rows :])
        o = newton_schulz(x.reshape(*lead, rows, cols), **ns) * scale_factor((rows, cols), scale_mode, extra)
        out.append(o.reshape(x.shape))
    return out[0] if len(out) == 1 else jnp.concatenate(out, axis=layer_dims + view.split_axis)


def _zeros(p) -> jax.Array:
    return jnp.zeros(p.shape, jnp.float32)


def _check(scale_mode: str, ns_steps: int, momentum: float) -> None:
    if scale_mode not in SCALE_MODES:
        raise ConfigError(f"muon: scale_mode={scale_mode!r} is not one of {', '.join(SCALE_MODES)}")
    if not isinstance(ns_steps, int) or ns_steps < 1:
        raise ConfigError(f"muon: ns_steps={ns_steps!r} must be an int >= 1")
    if not 0 <= momentum < 1:
        raise ConfigError(f"muon: momentum={momentum} must be in [0, 1)")


def muon(
    learning_rate: optax.ScalarOrSchedule,
    *,
    weight_decay: float = 0.0,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    momentum: float = 0.9,
    nesterov: bool = False,
    ns_steps: int = 5,
    ns_dtype=jnp.bfloat16,
    scale_mode: str = "spectral",
    extra_scale_factor: float = 1.0,
    is_muon: PyTree | Callable | None = None,
    layer_dims: PyTree | None = None,
    matrices: PyTree | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Megatron's Muon for the matrices, torch's AdamW for the rest (module docstring), with jzero's
    param groups.

    Arguments (Megatron's flag in brackets):
      learning_rate: a float or an optax schedule of the step count (`--lr` and its scheduler).
      weight_decay: decoupled, on both sides, times each param's `wd_mult` (`--weight-decay`). Without
        param groups every `wd_mult` is 1; Megatron's are 0 for biases and 1-D params
        (`groups.param_groups`), which `build_zero(groups=...)` passes in.
      b1, b2, eps: AdamW's (`--adam-beta1`, `--adam-beta2`, `--adam-eps`).
      momentum, nesterov: Muon's (`--muon-momentum`, `--muon-use-nesterov`).
      ns_steps: Newton-Schulz iterations (`--muon-num-ns-steps`).
      ns_dtype: their GEMMs' dtype: bf16 (`--muon-fp32-matmul-prec medium`) or fp32 (`high`).
      scale_mode, extra_scale_factor: `SCALE_MODES` (`--muon-scale-mode`, `--muon-extra-scale-factor`).
      is_muon: a tree of bools like the params, or `(path, param) -> bool`; default Megatron's rule
        (`muon_params`).
      layer_dims: per param its leading stacked-layer (or expert) dims, default 0: Newton-Schulz runs
        once per layer of a stacked [L, m, n] param. Without it such a stack is no matrix, so AdamW's
        (`optimizer.name: muon` passes the model's).
      matrices: per param its `MatrixView` (the matrix, or matrices, it is per layer) or None (no matrix:
        AdamW); default: one matrix for every param 2-D per layer. A model with fused or multi-dim
        kernels gives it (`GPTModel.muon_matrices`: Megatron's QKV split, the [H, K, D] output).

    Updates and state are laid out like the params (each param whole: the spec path).
    """
    _check(scale_mode, ns_steps, momentum)
    ns_dtype = jnp.dtype(ns_dtype)
    if ns_dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        raise ConfigError(f"muon: ns_dtype={ns_dtype} must be bfloat16 or float32")

    def init(params):
        leaves, treedef = jax.tree.flatten(params, is_leaf=_masked)
        views = _views(params, is_muon, layer_dims, matrices)
        return MuonState(
            count=jnp.zeros([], jnp.int32),
            momentum=jax.tree.map(_zeros, params),
            exp_avg_sq=treedef.unflatten(
                [p if _masked(p) else optax.MaskedNode() if v else _zeros(p) for p, v in zip(leaves, views)]
            ),
        )

    def update(updates, state, params=None, **extra_args):
        if params is None:
            raise ValueError("muon needs the params (its weight decay): pass them to update")
        views = _views(params, is_muon, layer_dims, matrices)
        count = optax.safe_increment(state.count)
        lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
        t = count.astype(jnp.float32)
        bc1, bc2_sqrt = 1 - b1**t, jnp.sqrt(1 - b2**t)
        lr_mult = multipliers(extra_args, "lr_mult", updates)
        wd_mult = multipliers(extra_args, "wd_mult", updates)
        ns = dict(steps=ns_steps, dtype=ns_dtype, scale_mode=scale_mode, extra_scale_factor=extra_scale_factor)

        def step(g, p, m, v, view, lr_m, wd_m):
            if _masked(g):
                return g, m, v
            g, p = g.astype(jnp.float32), p.astype(jnp.float32)
            rate = lr * lr_m
            decay = -(rate * (weight_decay * wd_m)) * p
            if view is not None:
                m = m + (1 - momentum) * (g - m)
                d = g + momentum * (m - g) if nesterov else m
                return decay - rate * orthogonalize(d, *view, **ns), m, v
            m = m + (1 - b1) * (g - m)
            v = _rounded(b2 * v) + (1 - b2) * g * g  # torch's mul_ then addcmul_: one fma
            return decay - (rate / bc1) * (m / (jnp.sqrt(v) / bc2_sqrt + eps)), m, v

        leaves, treedef = jax.tree.flatten(updates, is_leaf=_masked)
        others = [treedef.flatten_up_to(x) for x in (params, state.momentum, state.exp_avg_sq)]
        groups = [treedef.flatten_up_to(x) for x in (lr_mult, wd_mult)]
        out = [step(g, p, m, v, view, lr_m, wd_m)
               for g, p, m, v, view, lr_m, wd_m in zip(leaves, *others, views, *groups)]  # fmt: skip
        new_updates, new_m, new_v = (treedef.unflatten([o[i] for o in out]) for i in range(3))
        return new_updates, MuonState(count, new_m, new_v)

    return optax.GradientTransformationExtraArgs(init, update)
