"""The state both ZeRO paths train: `TrainState` (params, optimizer state, step, model state),
`ZeroState`, and `ModelState`, the hook for a model's non-trainable state.

The two paths lay the optimizer state out differently (per parameter on the spec path,
one array per flat bucket on the flat path) but hold the same things, in these types.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

PyTree = Any
LossFn = Callable[..., Any]  # (params, local batch) -> mean loss [, metrics]; see `build.build_zero`


class ZeroState(NamedTuple):
    """The distributed optimizer's state, sharded over each param's data-parallel domain.

    main_params: fp32 master copy, or None when the model params are fp32 (then, as in
      Megatron, the model params are the main params and no second copy is kept).
    inner_state: the wrapped optax transformation's state.
    grad_scaler: fp16's dynamic loss scale (`loss_scale.LossScaleState`, replicated scalars),
      None without loss scaling.
    spike: the grad-norm spike guard's history (`spike.SpikeState`, replicated), None without it.
    """

    main_params: PyTree | None
    inner_state: optax.OptState
    grad_scaler: Any = None
    spike: Any = None


class ModelState(NamedTuple):
    """A model's non-trainable state, carried by the step beside the params (Megatron's buffers: a
    MoE router's expert bias). It has no grad, no weight decay and no optimizer state; it is
    replicated on every device.

    With it, the loss is called as `loss_fn(params, batch, model_state=state, **axes)` and returns
    `(loss, metrics, stats)`: `stats` a pytree of arrays (e.g. tokens per expert) that the step sums
    over the data-parallel ranks and micro-batches, without grad. Once per step, after the grads are
    reduced and before the optimizer steps (Megatron's `finalize_model_grads`), the step calls
    `update(state, summed stats) -> (new state, {name: scalar} metrics)`; every micro-batch of the
    step runs with the state it started with.

    init: () -> the initial state (a pytree of arrays), traced under jit.
    update: (state, stats) -> (state, metrics), traced under jit on replicated arrays.
    """

    init: Callable[[], PyTree]
    update: Callable[[PyTree, PyTree], tuple[PyTree, dict]]


class TrainState(NamedTuple):
    """params: the model copy: the params tree (tp-sharded; replicated over DP, or split over it where
    the params rest sharded), or, on the flat path where they rest sharded, one array per flat bucket
    (`flat/state.py`; `Zero.full_params` reads them as the params tree); opt_state: `ZeroState`;
    step: scalar; model_state: the model's non-trainable state (`ModelState`), replicated, or None."""

    params: PyTree
    opt_state: ZeroState
    step: jax.Array
    model_state: PyTree = None


def with_metrics(loss_fn: LossFn, has_aux: bool) -> Callable[..., tuple[jax.Array, dict]]:
    """`loss_fn` as (params, batch, **axes) -> (loss, metrics): metrics is the dict of scalars a
    `has_aux` loss returns beside its loss (each averaged over ranks and microbatches by the step),
    else {}."""
    if has_aux:
        return loss_fn
    return lambda *args, **kwargs: (loss_fn(*args, **kwargs), {})


def loss_parts(loss_fn: LossFn, has_aux: bool, model_state: ModelState | None) -> Callable:
    """`loss_fn` as (params, batch, state, **axes) -> (loss, metrics, stats): with a `model_state`,
    `loss_fn(params, batch, model_state=state, **axes)` as it is; else `with_metrics`'s form with
    stats {} (and `state`, None, ignored)."""
    if model_state is not None:
        return lambda params, batch, state, **axes: loss_fn(params, batch, model_state=state, **axes)
    loss_metrics = with_metrics(loss_fn, has_aux)
    return lambda params, batch, state, **axes: (*loss_metrics(params, batch, **axes), {})


def model_state_shardings(model_state: ModelState | None, sharding) -> PyTree:
    """`sharding` (replicated) for every leaf of the model state, None without one."""
    return None if model_state is None else jax.tree.map(lambda _: sharding, jax.eval_shape(model_state.init))


def state_optional(program: Callable, model_state: ModelState | None, shardings: PyTree) -> Callable:
    """A jitted `program(params, batch, state)` as `(params, batch, model_state=None)`: None is the
    model's initial state (born in `shardings`), or None for a model without state."""
    init = None if model_state is None else jax.jit(model_state.init, out_shardings=shardings)

    def call(params, batch, model_state=None):
        return program(params, batch, init() if model_state is None and init is not None else model_state)

    return call


def keeps_main_params(abstract_params: PyTree, quantized_gather: bool = False) -> bool:
    """Whether the state holds fp32 main params beside the model params: Megatron keeps them only when
    some model param is not fp32; jzero also keeps them under a quantized param gather
    (`ZeroConfig.param_gather_dtype`), whose model copy is no longer the main params."""
    return quantized_gather or any(jnp.dtype(p.dtype) != jnp.float32 for p in jax.tree.leaves(abstract_params))


def init_train_state(
    init_params: Callable[[], PyTree],
    init_opt: Callable[[PyTree], ZeroState],
    shardings: TrainState,
    to_state: Callable[[PyTree], PyTree] | None = None,
    model_state: ModelState | None = None,
) -> TrainState:
    """Builds the state jitted straight into its shardings: nothing is materialised whole.

    Arguments:
      init_params: () -> params (global shapes), traced under jit.
      init_opt: the state's params -> `ZeroState` (the path's optimizer init).
      shardings: a TrainState of NamedShardings.
      to_state: the params tree -> what the state holds (`engine.Layout.to_state`), None: the tree.
      model_state: the model's `ModelState` (its `init` gives the state), or None.
    """

    def init():
        params = jax.tree.map(jnp.asarray, init_params())  # a Python scalar leaf too, as optax takes one
        params = params if to_state is None else to_state(params)
        extra = None if model_state is None else model_state.init()
        return TrainState(params, init_opt(params), jnp.zeros((), jnp.int32), extra)

    return jax.jit(init, out_shardings=shardings)()
