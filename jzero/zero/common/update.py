"""The optimizer step both paths share, once the reduced grads are in hand: `optimizer_step`, then `finish`.

Megatron's `DistributedOptimizer.step` in order: unscale fp16's grads and check them for inf/nan,
take the global norm and clip by it, step the inner optimizer on the fp32 main params (or on the
fp32 params themselves), keep the old main params where a guard skips the step (`kept_main`: loss
scaling's inf/nan, the nan check, the spike guard), cast them back to the model's dtype
(`model_copy`), and keep the old params and inner state there too (`finish`). The paths differ only
in the layout of what they pass in (per parameter, or one array per flat bucket shard), in how they
compute the norm and the inf/nan flag over the ranks (XLA over sharded arrays, or explicit psums over
buffer shards), and in how the new params travel back (a sharding constraint, or an all_gather per
bucket).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jzero.zero.common import loss_scale as scaler
from jzero.zero.common import spike
from jzero.zero.common.groups import EXTRA_ARG, GroupValues, with_extra_args
from jzero.zero.common.state import ZeroState
from jzero.zero.config import DynamicLossScale, SpikeGuard

PyTree = Any


class Update(NamedTuple):
    """What `optimizer_step` computed, laid out as its inputs (per param, or per bucket shard).

    main: the updated fp32 main params; inner_state: the inner transformation's new state;
    norm: the global grad norm before clipping; skip: under loss scaling, True where an inf/nan
    in the grads skips the step (None without loss scaling).
    """

    main: PyTree
    inner_state: optax.OptState
    norm: jax.Array
    skip: jax.Array | None


def optimizer_step(
    inner: optax.GradientTransformation,
    grads: PyTree,
    main: PyTree,
    state: ZeroState,
    *,
    global_norm: Callable[[PyTree], jax.Array],
    nonfinite: Callable[[PyTree], jax.Array],
    clip_grad: float | None,
    loss_scale: DynamicLossScale | None,
    groups: GroupValues | None,
) -> Update:
    """Megatron's `DistributedOptimizer.step` on one rank's fp32 grads and main params (module docstring).

    Arguments:
      grads: the reduced fp32 grads, laid out like `main` (of the loss x the scale under loss scaling).
      main: the fp32 main params the rank steps (its shards; the fp32 params when none are kept).
      state: the ZeroState whose `inner_state` (and `grad_scaler`) the step reads.
      global_norm: grads -> the norm over every element once, across all ranks.
      nonfinite: grads -> whether any element on any rank is inf or nan (loss scaling only).
      groups: the param groups' multipliers laid out like `grads`, or None.
    """
    skip = None
    if loss_scale is not None:
        grads = scaler.unscale(grads, state.grad_scaler.loss_scale)
        skip = nonfinite(grads)
    norm = global_norm(grads)
    if clip_grad is not None:
        coeff = clip_coefficient(norm, clip_grad)
        grads = jax.tree.map(lambda g: g * coeff.astype(g.dtype), grads)
    updates, inner_state = inner_update(inner, grads, state.inner_state, main, groups)
    return Update(optax.apply_updates(main, updates), inner_state, norm, skip)


def finish(
    loss_scale: DynamicLossScale | None,
    update: Update,
    params: PyTree,
    state: ZeroState,
    new_params: PyTree,
    new_state: ZeroState,
    skip_nonfinite: bool = False,
    spike_guard: SpikeGuard | None = None,
) -> tuple[PyTree, ZeroState, dict]:
    """The step's (params, state, metrics): the new ones and {"grad_norm"}, or the old params and inner
    state (bitwise, by a select) where a guard skips the step, with {"skipped"}; `new_state`'s main
    params are `kept_main`'s, the old ones there already:
      - loss scaling: an inf/nan in the grads (`update.skip`); the scaler is updated and
        {"loss_scale"} reported (`loss_scale.update`);
      - `skip_nonfinite` (without loss scaling, which skips such steps already): an inf or nan grad
        norm, Megatron's --check-for-nan-in-loss-and-grad, checked before the update;
      - `spike_guard`: a grad norm above its recent mean (`spike.py`), reported as {"spike_skipped"};
        its history is updated.
    Without a guard the step is the same program as before any existed."""
    metrics = {"grad_norm": update.norm}
    if loss_scale is not None:
        metrics["loss_scale"] = state.grad_scaler.loss_scale
    skip, spiked = _guards(loss_scale, update, state, skip_nonfinite, spike_guard)
    if skip is None:
        return new_params, new_state, metrics
    params, inner_state = scaler.skip_if(skip, (params, state.inner_state), (new_params, new_state.inner_state))
    new_state = new_state._replace(inner_state=inner_state)
    metrics["skipped"] = skip.astype(jnp.float32)
    if loss_scale is not None:
        new_state = new_state._replace(grad_scaler=scaler.update(loss_scale, state.grad_scaler, update.skip))
    if spike_guard is not None:
        new_state = new_state._replace(spike=spike.update(spike_guard, state.spike, update.norm, spiked))
        metrics["spike_skipped"] = spiked.astype(jnp.float32)
    return params, new_state, metrics


def kept_main(
    loss_scale: DynamicLossScale | None,
    update: Update,
    state: ZeroState,
    main: PyTree,
    skip_nonfinite: bool = False,
    spike_guard: SpikeGuard | None = None,
) -> PyTree:
    """The step's new main params: `update.main`, or the old `main` (bitwise, by a select) where a guard
    (`finish`'s) skips the step. The state keeps them and the new params are made from them: where the
    step is skipped `finish` selects the old params anyway, so those come out as from `update.main`, and
    the update writes one fp32 copy of the main params where it wrote two (the selected one for the
    state, the unselected one for the cast): LLaMA-3.2-1B's shape on the flat path, one H200, 5.0 GB a
    step less under the nan check (experiments/bench/README.md, "Roofline")."""
    skip, _ = _guards(loss_scale, update, state, skip_nonfinite, spike_guard)
    return update.main if skip is None else scaler.skip_if(skip, main, update.main)


def _guards(loss_scale, update: Update, state: ZeroState, skip_nonfinite: bool, spike_guard) -> tuple:
    """(skip, spiked): whether a guard skips the step (`finish`'s list; None where none is on) and the spike
    guard's verdict (None without it)."""
    skip = update.skip if loss_scale is not None else None
    if loss_scale is None and skip_nonfinite:
        skip = jnp.logical_not(jnp.isfinite(update.norm))
    spiked = None
    if spike_guard is not None:
        spiked = spike.is_spike(spike_guard, state.spike, update.norm)
        skip = spiked if skip is None else jnp.logical_or(skip, spiked)
    return skip, spiked


def clip_coefficient(norm: jax.Array, max_norm: float) -> jax.Array:
    """Megatron's clipping factor `min(1, max_norm / (norm + 1e-6))` (docs/megatron.md)."""
    return jnp.minimum(1.0, max_norm / (norm + 1e-6))


def inner_update(
    inner: optax.GradientTransformation,
    grads: PyTree,
    inner_state: optax.OptState,
    main: PyTree,
    groups: GroupValues | None,
) -> tuple[PyTree, optax.OptState]:
    """The inner transformation's (updates, new state) for the fp32 main params; the caller adds
    the updates to the main params (`optax.apply_updates`).

    `groups` (laid out like `grads`) reaches the inner transformation as the extra argument
    `param_groups`; transformations that do not take extra arguments never see it.
    """
    extra = {} if groups is None else {EXTRA_ARG: groups}
    return with_extra_args(inner).update(grads, inner_state, main, **extra)


def model_copy(main: PyTree, dtypes: PyTree) -> PyTree:
    """Megatron's `_copy_main_params_to_model_params`: the main params cast to each param's dtype."""
    return jax.tree.map(lambda m, d: m.astype(d), main, dtypes)
