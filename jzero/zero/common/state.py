"""The state both ZeRO paths train: `TrainState` (params, optimizer state, step) and `ZeroState`.

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
    """

    main_params: PyTree | None
    inner_state: optax.OptState
    grad_scaler: Any = None


class TrainState(NamedTuple):
    """params: the model copy: the params tree (tp-sharded; replicated over DP, or split over it where
    the params rest sharded), or, on the flat path where they rest sharded, one array per flat bucket
    (`flat/state.py`; `Zero.full_params` reads them as the params tree); opt_state: `ZeroState`;
    step: scalar."""

    params: PyTree
    opt_state: ZeroState
    step: jax.Array


class Programs(NamedTuple):
    """What each path builds for `build.build_zero` (the `Zero` fields of the same names).

    shardings: a TrainState of NamedShardings. init_opt: params -> ZeroState, called under jit.
    step: jitted (state, batch) -> (state, metrics). grads: jitted (params, batch) -> the reduced
    grads. evaluate: jitted (params, batch) -> {"loss", **metrics}, the step's forward without grads.
    to_state: traceable params tree -> what `TrainState.params` holds, or None (the tree itself).
    """

    shardings: TrainState
    init_opt: Callable
    step: Callable
    grads: Callable
    evaluate: Callable
    to_state: Callable | None = None


def with_metrics(loss_fn: LossFn, has_aux: bool) -> Callable[..., tuple[jax.Array, dict]]:
    """`loss_fn` as (params, batch, **axes) -> (loss, metrics): metrics is the dict of scalars a
    `has_aux` loss returns beside its loss (each averaged over ranks and microbatches by the step),
    else {}."""
    if has_aux:
        return loss_fn
    return lambda *args, **kwargs: (loss_fn(*args, **kwargs), {})


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
) -> TrainState:
    """Builds the state jitted straight into its shardings: nothing is materialised whole.

    Arguments:
      init_params: () -> params (global shapes), traced under jit.
      init_opt: the state's params -> `ZeroState` (the path's optimizer init).
      shardings: a TrainState of NamedShardings.
      to_state: the params tree -> what the state holds (`Programs.to_state`), None: the tree.
    """

    def init():
        params = init_params()
        params = params if to_state is None else to_state(params)
        return TrainState(params, init_opt(params), jnp.zeros((), jnp.int32))

    return jax.jit(init, out_shardings=shardings)()
