"""Flax models in a ZeRO step: Megatron's row-parallel reductions and FSDP units around a module's own layers.

`jzero.zero.build_zero` takes any params pytree and any loss; a Flax model needs three things from it
that its own code does not say (docs/flax.md has a whole example of each):

- **Row-parallel reductions on the flat path.** With a tp spec that splits a param the flat path runs
  the loss on tp-local params `W[D, F_tp]` inside `shard_map` and calls it with `tp_axis=`. The model
  is then built with local sizes (heads // tp, mlp // tp: the user's constructor) and Megatron's
  row-parallel linears (attention out-projection, MLP fc2) sum their outputs over tp:
  `psum(x @ W[F_tp, D], tp) + b[D]`, the bias added once, after the sum, as Megatron's
  `RowParallelLinear` does. `row_parallel` (Linen) and `nnx_row_parallel` (NNX) make named
  `Dense`/`DenseGeneral` (`Linear`/`LinearGeneral`) layers so; without `tp_axis` (the spec path,
  global params under jit, or tp 1) they change nothing.
- **FSDP units.** Each transformer block runs as `jzero.zero.unit(fn, block_params, x)`, so that ZeRO-3
  gathers its params just before it runs and every stage reduces its grads right after its backward.
  `unit_calls` (Linen) and `nnx_unit_calls` (NNX) send the selected blocks' `__call__` through `unit`;
  `units(params, ...)` gives `build_zero`'s `units=` for the same blocks.
- **Flax's trees.** Linen's `{"params": {...}}` and NNX's `nnx.to_pure_dict(nnx.state(model, nnx.Param))`
  are plain pytrees of arrays; the flat path names each block's unit from its path (`flat/plan.unit_key`
  reads `params/blocks_3`, `params/Block_3` and NNX's `blocks/3` as one block each).

Blocks and layers are selected by name: `"blocks"` selects a module named `blocks`, the items of a
list attribute `blocks` (Linen names them `blocks_0`, `blocks_1`, ...; NNX keys them `blocks/0`, ...)
and, in Linen's compact modules, `"Block"` the unnamed `Block(...)` submodules (`Block_0`, ...).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from typing import Any

import flax.linen as nn
import jax
from flax import nnx

from jzero.errors import ConfigError
from jzero.zero import unit
from jzero.zero.flat.plan import FLAX_COLLECTION

PyTree = Any
COLLECTION = FLAX_COLLECTION  # Linen's trainable params, `variables["params"]`: one name with flat/plan.py


def _selects(name, names: tuple[str, ...]) -> bool:
    """Whether a module (or param path key) `name` is one of `names` or item `<name>_<i>` of one."""
    return isinstance(name, str) and any(name == n or re.fullmatch(rf"{re.escape(n)}_\d+", name) for n in names)


def _array_args(args: tuple, kwargs: dict) -> tuple[list, Callable[[tuple], tuple[tuple, dict]]]:
    """A call's array arguments (what `unit` passes on) and the function putting them back among the others
    (masks of None, flags), which `unit`'s fn then closes over."""
    leaves, treedef = jax.tree.flatten((args, kwargs))
    at = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]

    def rebuild(arrays: tuple) -> tuple[tuple, dict]:
        full = list(leaves)
        for i, x in zip(at, arrays):
            full[i] = x
        return jax.tree.unflatten(treedef, full)

    return [leaves[i] for i in at], rebuild


def _row_parallel_out(y: jax.Array, bias: jax.Array | None, tp_axis: str) -> jax.Array:
    """psum(y, tp) + bias: y the tp-local partial product `x[..., F_tp] @ W[F_tp, D]`, bias [D] replicated."""
    y = jax.lax.psum(y, tp_axis)
    return y if bias is None else y + bias.astype(y.dtype)


# ---------------------------------------------------------------- Linen


@contextlib.contextmanager
def row_parallel(tp_axis: str | None, *names: str) -> Iterator[None]:
    """Inside it, the Linen `nn.Dense`/`nn.DenseGeneral` layers named `names` (their `name`, e.g. `"out"`,
    `"fc2"`) are Megatron's row-parallel linears: `psum(x @ kernel, tp_axis) + bias`.

    Arguments:
      tp_axis: the `tp_axis` the flat path gives the loss (params tp-local: the kernel `W[F_tp, D]`, its
        input `x[..., F_tp]`, the bias `b[D]` whole, replicated over tp); None (the spec path, whose
        params are global under jit, or tp 1): a no-op.
      names: the layers' names. A layer with `batch_dims` is refused (ConfigError).

    Example: `with row_parallel(tp_axis, "out", "fc2"): logits = model.apply({"params": params}, tokens)`.
    """
    if tp_axis is None:
        yield
        return
    bare_ids: set[int] = set()

    def interceptor(next_fun, args, kwargs, context):
        m = context.module
        if context.method_name != "__call__" or id(m) in bare_ids or not _selects(m.name, names):
            return next_fun(*args, **kwargs)
        if not isinstance(m, (nn.Dense, nn.DenseGeneral)) or getattr(m, "batch_dims", ()):
            name = "/".join(map(str, m.path)) or m.name
            raise ConfigError(
                f"jzero.interop.flax.row_parallel: layer {name} is a {type(m).__name__}; a row-parallel layer is an "
                "nn.Dense or an nn.DenseGeneral without batch_dims"
            )
        bare = m.clone(parent=m.scope, use_bias=False)  # the same kernel, in the same scope, no bias
        bare_ids.add(id(bare))
        try:
            y = bare(*args, **kwargs)
        finally:
            bare_ids.discard(id(bare))
        return _row_parallel_out(y, m.get_variable(COLLECTION, "bias") if m.use_bias else None, tp_axis)

    with nn.intercept_methods(interceptor):
        yield


@contextlib.contextmanager
def unit_calls(*names: str, **unit_kwargs) -> Iterator[None]:
    """Inside it, each Linen block named `names` (module docstring: a list attribute `"blocks"`, or `"Block"`
    for compact submodules) runs as one FSDP unit: its `__call__` as
    `jzero.zero.unit(fn, block_params, *arrays)`, `fn` applying the block to its materialized params.

    In a ZeRO step the block's params arrive as jzero's unit leaves (their shards under ZeRO-3, their
    local tp shards on the flat path) and `unit` hands `fn` the params the block computes with; outside
    one (`model.init`, inference) `unit` is a plain call, and while the module initializes the block
    runs as it is. The block's other collections are read as they are (no mutable state inside a unit);
    its rngs are the parent's streams. `unit_kwargs`: `unit`'s `remat`, `policy`, `prevent_cse`.

    Example: `with unit_calls("blocks"): logits = model.apply({"params": params}, tokens)`, with
    `build_zero(..., units=units(params, "blocks"))`.
    """
    applying: list[bool] = []  # set while `fn` applies a block on its own: that call is not a unit call
    running: set[int] = set()  # the blocks `fn` runs: their own nested calls (`super().__call__`) are not either

    def interceptor(next_fun, args, kwargs, context):
        m = context.module
        if (context.method_name != "__call__" or not _selects(m.name, names) or m.is_initializing()
                or id(m) in running):  # fmt: skip
            return next_fun(*args, **kwargs)
        if applying:
            applying.pop()
            running.add(id(m))
            try:
                return next_fun(*args, **kwargs)
            finally:
                running.discard(id(m))
        params = m.variables.get(COLLECTION, {})  # the block's: unit leaves in a ZeRO step, else arrays
        others = {k: v for k, v in m.variables.items() if k != COLLECTION}
        rngs = {name: m.make_rng(name) for name in m.scope.rngs}
        arrays, rebuild = _array_args(args, kwargs)
        bare = m.clone(parent=None)

        def fn(params, *arrays):
            a, kw = rebuild(arrays)
            applying.append(True)
            try:
                return bare.apply({COLLECTION: params, **others}, *a, rngs=rngs or None, **kw)
            finally:
                applying.clear()

        return unit(fn, params, *arrays, **unit_kwargs)

    with nn.intercept_methods(interceptor):
        yield


def units(params: PyTree, *names: str, stacked: bool = False) -> PyTree:
    """`build_zero`'s `units=` for the blocks `names` (module docstring) of a Flax params tree: per param 0
    where a key on its path is a selected block's (`blocks_3`, `Block_3`; NNX's `blocks`, whose items are
    the blocks), None elsewhere (embeddings, final norm, head).

    Arguments:
      params: Linen's `{"params": ...}` (or what is under it), or NNX's `nnx.to_pure_dict` of its
        `nnx.Param`s: global shapes, arrays or `ShapeDtypeStruct`s.
      stacked: the selected blocks are `nn.scan` stacks, each param `[L, ...]`: 1 (one unit per layer).
    """

    def unit_dims(path, _):
        keys = [getattr(k, "key", getattr(k, "idx", getattr(k, "name", None))) for k in path]
        return int(stacked) if any(_selects(k, names) for k in keys) else None

    return jax.tree_util.tree_map_with_path(unit_dims, params)


# ---------------------------------------------------------------- NNX


class _RowParallel(nnx.Module):
    """An `nnx.Linear`/`nnx.LinearGeneral` as Megatron's row-parallel linear (`nnx_row_parallel`)."""

    def __init__(self, layer: nnx.Module, tp_axis: str):
        self.layer, self.tp_axis = layer, tp_axis

    def __call__(self, x, *args, **kwargs):
        layer, bias = self.layer, self.layer.bias
        if bias is None:
            return _row_parallel_out(layer(x, *args, **kwargs), None, self.tp_axis)
        layer.bias, layer.use_bias = None, False  # the layer's own product, without its bias
        try:
            y = layer(x, *args, **kwargs)
        finally:
            layer.bias, layer.use_bias = bias, True
        return _row_parallel_out(y, bias[...], self.tp_axis)


class _Unit(nnx.Module):
    """A block whose `__call__` is one FSDP unit (`nnx_unit_calls`)."""

    def __init__(self, block: nnx.Module, unit_kwargs: dict):
        self.block, self.unit_kwargs = block, tuple(sorted(unit_kwargs.items()))  # static: hashable

    def __call__(self, *args, **kwargs):
        graphdef, state = nnx.split(self.block)  # the block's state: unit leaves in a ZeRO step, else arrays
        arrays, rebuild = _array_args(args, kwargs)

        def fn(state, *arrays):
            a, kw = rebuild(arrays)
            return nnx.merge(graphdef, state)(*a, **kw)

        return unit(fn, state, *arrays, **dict(self.unit_kwargs))


def _replace(module: nnx.Module, select, wrap) -> nnx.Module:
    """`module` with each submodule `select(path, sub)` picks replaced, in place, by `wrap(sub)`."""
    chosen = [(path, sub) for path, sub in nnx.iter_modules(module) if path and select(path, sub)]
    for path, sub in chosen:
        parent = module
        for k in path[:-1]:
            parent = parent[k] if isinstance(k, int) else getattr(parent, k)
        if isinstance(path[-1], int):
            parent[path[-1]] = wrap(sub)
        else:
            setattr(parent, path[-1], wrap(sub))
    return module


def nnx_row_parallel(module: nnx.Module, tp_axis: str | None, *names: str) -> nnx.Module:
    """`module` (changed in place) with its `nnx.Linear`/`nnx.LinearGeneral` layers named `names` (their
    attribute names, e.g. `"out"`, `"fc2"`) as Megatron's row-parallel linears, `psum(x @ kernel, tp_axis)
    + bias`; tp_axis None (global params, or tp 1): unchanged. Shardings as `row_parallel`'s: the kernel
    `W[F_tp, D]`, the bias `b[D]` whole. Call it on the model `nnx.merge` builds inside the loss."""
    if tp_axis is None:
        return module

    def select(path, sub):
        if not _selects(path[-1], names):
            return False
        if not isinstance(sub, (nnx.Linear, nnx.LinearGeneral)) or getattr(sub, "batch_axis", None):
            raise ConfigError(
                f"jzero.interop.flax.nnx_row_parallel: layer {'/'.join(map(str, path))} is a {type(sub).__name__}; a "
                "row-parallel layer is an nnx.Linear or an nnx.LinearGeneral without batch_axis"
            )
        return True

    return _replace(module, select, lambda sub: _RowParallel(sub, tp_axis))


def nnx_unit_calls(module: nnx.Module, *names: str, **unit_kwargs) -> nnx.Module:
    """`module` (changed in place) with each block named `names` (an attribute `"block"`, or every item of a
    list `"blocks"`: `nnx.List`) running as one FSDP unit, `jzero.zero.unit(fn, block_state, *arrays)`, as
    `unit_calls` does for Linen. Call it on the model `nnx.merge` builds inside the loss;
    `units(params, *names)` gives `build_zero`'s `units=`. `unit_kwargs`: `unit`'s `remat`, `policy`,
    `prevent_cse`."""

    def select(path, sub):
        if isinstance(path[-1], int):  # an item of a list the names select
            return len(path) > 1 and _selects(path[-2], names)
        return _selects(path[-1], names) and not isinstance(sub, nnx.List)

    return _replace(module, select, lambda sub: _Unit(sub, unit_kwargs))
