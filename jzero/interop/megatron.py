"""Megatron-LM's distributed-optimizer checkpoints in and out of jzero: continue a Megatron run in
JAX, and go back (docs/megatron.md, "Moving a run between Megatron and jzero"). This module loads
one into a `Zero`'s TrainState, and is where the whole interface is imported from.

Megatron saves the distributed optimizer's state as its flat buffer, which its files keep with
the bucket-end padding cut out (`jzero.interop.megatron_format`), so a checkpoint loads onto any
jzero mesh, strategy and path whatever DP size wrote it. `read` cuts the buffers back into
per-parameter arrays (model space, Megatron's names; `jzero.interop.megatron_read`);
`to_train_state` / `load` put them into a `Zero`'s TrainState through its `from_model_space`;
`save` writes the legacy format from a TrainState for any tensor, pipeline and expert model-parallel
sizes (`jzero.interop.megatron_save`; `write` from model space). `names` says
which Megatron param each jzero param is: a pytree shaped like the params whose leaves are
Megatron names, or `Renamed` where the layouts differ (`jzero.interop.megatron_names`; jzero's
GPT: `jzero.interop.gpt`).

Adam's step count: jzero continues from the checkpoint's iteration (its optimizer's counts, hence
the bias correction and the LR schedule, are set to it; `MegatronCheckpoint.notes` says so). The
`step` in the param groups is the same number when Megatron saved a run it trained from the start;
Megatron-Core 0.16.1's torch-AdamW fallback can save another one after it resumed (it resets or
shares the per-param step on load), which jzero reports and does not use.

What is read, and what is refused: `jzero.interop.megatron_read`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np

from jzero.interop import InteropError
from jzero.interop.megatron_format import (
    EXTRA_STATE,
    MODEL_FILE,
    MOMENTS,
    OPTIM_FILE,
    TRACKER,
    bucket_positions,
    layout_bucket_numels,
)
from jzero.interop.megatron_names import OPTAX_MOMENT, Renamed, adam_moment, names_per_param, renamed
from jzero.interop.megatron_read import MegatronCheckpoint, find, read
from jzero.interop.megatron_save import Hyperparams, save, write
from jzero.zero import Zero
from jzero.zero.common import spike
from jzero.zero.common.state import TrainState, ZeroState

__all__ = [
    "EXTRA_STATE",
    "MODEL_FILE",
    "MOMENTS",
    "OPTIM_FILE",
    "TRACKER",
    "Hyperparams",
    "MegatronCheckpoint",
    "Renamed",
    "bucket_positions",
    "find",
    "layout_bucket_numels",
    "load",
    "read",
    "renamed",
    "save",
    "to_train_state",
    "write",
]

PyTree = Any


def _from_megatron(r: Renamed, arrays: dict[str, np.ndarray], shape, what: str) -> np.ndarray:
    missing = [n for n in r.names if n not in arrays]
    if missing:
        raise InteropError(f"{what} has no param {missing[0]}")
    got = tuple(arrays[n] for n in r.names)
    try:
        x = np.asarray(r.from_megatron(got))
    except (ValueError, TypeError, IndexError):  # a reshape or transpose of arrays of other shapes
        x = None
    if x is None or x.shape != tuple(shape):
        shapes = ", ".join(f"{n} {tuple(a.shape)}" for n, a in zip(r.names, got))
        raise InteropError(f"{what}: Megatron's {shapes} do not give the model's param of shape {tuple(shape)}")
    return x


def to_train_state(ck: MegatronCheckpoint, zero: Zero, names: PyTree) -> TrainState:
    """The train state of `ck` in `zero.shardings` (module docstring): the params (the checkpoint's
    fp32 main params when the model's params are fp32, else its weights), the fp32 main params where
    kept, Adam's moments, and the step: every count of the optimizer state is the iteration.

    `zero`'s optimizer state must be Adam's (optax's ScaleByAdamState mu and nu, and scalar counts);
    any other leaf is refused, naming it.
    """
    what = f"Megatron checkpoint {ck.path}"
    tensors = jax.tree.leaves(zero.plan.tensors)
    leaves = names_per_param(names, zero)
    used = {n for r in leaves for n in r.names}
    unused = [n for n in ck.model if n not in used]
    if unused:
        raise InteropError(f"{what}: param {unused[0]} (and {len(unused) - 1} more) has no counterpart in names")

    def per_param(arrays: dict[str, np.ndarray]) -> list[np.ndarray]:
        return [_from_megatron(r, arrays, t.shape, what) for r, t in zip(leaves, tensors)]

    main, mu, nu = per_param(ck.main), per_param(ck.exp_avg), per_param(ck.exp_avg_sq)
    index = {tuple(path): i for i, (path, _) in enumerate(jax.tree_util.tree_flatten_with_path(zero.plan.tensors)[0])}
    treedef = jax.tree.structure(zero.plan.tensors)
    abstract_params = jax.tree.map(lambda t: jax.ShapeDtypeStruct(t.shape, t.dtype), zero.plan.tensors)
    held = jax.eval_shape(zero.params_from_model, abstract_params)  # what the state holds: the params or bucket shards
    model_abstract = jax.eval_shape(zero.to_model_space, jax.eval_shape(zero.init_opt, held))
    if model_abstract.grad_scaler is not None:
        raise InteropError("float16 params with loss scaling: jzero does not convert Megatron's grad scaler")
    moments = {"exp_avg": mu, "exp_avg_sq": nu}

    def fill(path, leaf):
        owner = zero.plan.param_of(tuple(path))
        field = adam_moment(path)
        if owner is not None and field is not None and tuple(leaf.shape) == zero.plan.tensor(owner).shape:
            return moments[OPTAX_MOMENT[field]][index[owner]].astype(leaf.dtype)
        if leaf.shape == () and np.issubdtype(leaf.dtype, np.integer):
            return np.asarray(ck.iteration, leaf.dtype)  # Adam's and the schedules' step counts
        raise InteropError(
            f"optimizer state leaf {jax.tree_util.keystr(tuple(path))} has no counterpart in Megatron's Adam "
            "(exp_avg, exp_avg_sq, step): jzero loads Megatron checkpoints into Adam or AdamW"
        )

    inner = jax.tree_util.tree_map_with_path(fill, model_abstract.inner_state)
    keep_main = model_abstract.main_params is not None
    params = []
    for i, (t, r) in enumerate(zip(tensors, leaves)):
        weights = _from_megatron(r, ck.model, t.shape, what)
        # fp32 params are their own main params (Megatron's and jzero's); else the model copy as saved
        params.append((main[i] if not keep_main or weights.dtype != t.dtype else weights).astype(t.dtype))
    guard = zero.options.spike_guard  # the grad-norm spike guard's history starts empty
    model_opt = ZeroState(
        jax.tree.unflatten(treedef, [m.astype(np.float32) for m in main]) if keep_main else None, inner, None,
        None if guard is None else spike.init(guard),
    )  # fmt: skip
    model_opt = jax.device_put(model_opt, zero.model_opt_shardings)
    opt = jax.jit(zero.from_model_space, out_shardings=zero.shardings.opt_state)(model_opt)
    # The model's non-trainable state (a MoE router's expert bias) starts from its initial value: its
    # Megatron buffers are not read.
    model_state = None
    if zero.model_state is not None:
        model_state = jax.jit(zero.model_state.init, out_shardings=zero.shardings.model_state)()
    return TrainState(
        zero.params_from_model(jax.device_put(jax.tree.unflatten(treedef, params), zero.model_param_shardings)),
        opt,
        jax.device_put(np.asarray(ck.iteration, np.int32), zero.shardings.step),
        model_state,
    )


def load(path: str | Path, zero: Zero, names: PyTree, *, bucket_size: int | None = None) -> TrainState:
    """Megatron's checkpoint at `path` as `zero`'s TrainState, in `zero.shardings` (`read`,
    `to_train_state`). `names`: a pytree shaped like the params whose leaves are Megatron's param
    names (or `Renamed`); the buffer's param order is read from the checkpoint, not from `names`."""
    flat_names = [n for leaf in jax.tree.leaves(names, is_leaf=lambda x: isinstance(x, Renamed))
                  for n in renamed(leaf).names]  # fmt: skip
    return to_train_state(read(path, bucket_size=bucket_size, names=flat_names), zero, names)
