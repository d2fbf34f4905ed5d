"""Dynamic loss scaling for fp16 params: Megatron's `DynamicGradScaler`, as pure functions.

fp16 has 5 exponent bits: small gradients underflow to 0. The step multiplies the loss by the
current scale before differentiating, so the fp16 backward and the grad reduction carry
`scale x grad`; the optimizer unscales the reduced grads in fp32 (`unscale`) and checks them.
An inf or nan anywhere in them, on any rank (`found_inf` is one all-reduced flag), skips the
whole step: params, fp32 main params, optimizer moments and the optimizer's own step count stay
exactly as they were (`skip_if`), and the scale backs off. Megatron's rules (`update`):

  inf/nan found: growth_tracker = 0; hysteresis_tracker -= 1; once it is <= 0, every further
                 inf/nan step multiplies the scale by `backoff_factor` (not below `min_loss_scale`).
  finite grads:  growth_tracker += 1; at `loss_scale_window` it resets to 0, the hysteresis
                 tracker to `hysteresis`, and the scale is multiplied by `growth_factor`.

Names and defaults are Megatron's (`--initial-loss-scale`, `--min-loss-scale`,
`--loss-scale-window`, `--hysteresis`; backoff 0.5, growth 2). The state is three replicated
scalars, kept in `ZeroState.grad_scaler` and saved with the checkpoint.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jzero.zero.config import DynamicLossScale

PyTree = Any


class LossScaleState(NamedTuple):
    """Replicated scalars: the scale (fp32), Megatron's two trackers and the number of steps skipped
    so far (int32; the optimizer has taken `TrainState.step - skipped` steps)."""

    loss_scale: jax.Array
    growth_tracker: jax.Array
    hysteresis_tracker: jax.Array
    skipped: jax.Array


def shardings(mesh: Mesh) -> LossScaleState:
    """The state's shardings: every scalar replicated."""
    return LossScaleState(*[NamedSharding(mesh, P())] * len(LossScaleState._fields))


def init(cfg: DynamicLossScale) -> LossScaleState:
    scale = jnp.asarray(cfg.initial_loss_scale, jnp.float32)
    zero = jnp.zeros((), jnp.int32)
    return LossScaleState(scale, zero, jnp.asarray(cfg.hysteresis, jnp.int32), zero)


def update(cfg: DynamicLossScale, state: LossScaleState, found_inf: jax.Array) -> LossScaleState:
    """The state after a step that found (or not) an inf/nan in its grads (module docstring)."""
    hyst = jnp.where(found_inf, state.hysteresis_tracker - 1, state.hysteresis_tracker)
    growth = jnp.where(found_inf, 0, state.growth_tracker + 1)
    backoff = jnp.maximum(state.loss_scale * cfg.backoff_factor, cfg.min_loss_scale)
    grow = jnp.logical_and(jnp.logical_not(found_inf), growth == cfg.loss_scale_window)
    scale = jnp.where(found_inf & (hyst <= 0), backoff, state.loss_scale)
    scale = jnp.where(grow, state.loss_scale * cfg.growth_factor, scale)
    return LossScaleState(
        scale.astype(jnp.float32),
        jnp.where(grow, 0, growth).astype(jnp.int32),
        jnp.where(grow, cfg.hysteresis, hyst).astype(jnp.int32),
        state.skipped + found_inf.astype(jnp.int32),
    )


def scaled_loss(loss_metrics, loss_scale: jax.Array | None):
    """`loss_metrics` ((params, batch, **axes) -> (loss, metrics), or (loss, metrics, stats)) as a
    function to differentiate: -> (loss x loss_scale, (loss, metrics[, stats])); unchanged (loss,
    (loss, ...)) for loss_scale None."""

    def fn(*args, **kwargs):
        loss, *aux = loss_metrics(*args, **kwargs)
        scaled = loss if loss_scale is None else loss.astype(jnp.float32) * loss_scale.astype(jnp.float32)
        return scaled, (loss, *aux)

    return fn


def unscale(grads: PyTree, loss_scale: jax.Array) -> PyTree:
    """fp32 grads divided by the scale (Megatron multiplies by its fp32 inverse, as here)."""
    inv = 1.0 / loss_scale.astype(jnp.float32)  # exact: the scale is a power of 2 under the defaults
    return jax.tree.map(lambda g: g * inv, grads)


def found_inf(grads: PyTree) -> jax.Array:
    """True if any element of `grads` is inf or nan. On sharded arrays XLA reduces each shard and
    all-reduces the flag, so every rank gets the same answer."""
    flags = [jnp.logical_not(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads)]
    return jnp.any(jnp.stack(flags)) if flags else jnp.asarray(False)


def skip_if(skip: jax.Array, old: PyTree, new: PyTree) -> PyTree:
    """`old` where `skip`, else `new`, leaf by leaf (a select: the old values come back bitwise)."""
    return jax.tree.map(lambda o, n: jnp.where(skip, o, n), old, new)
