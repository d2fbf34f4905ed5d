"""Low-precision optimizer state: the moments stored in bf16, the math in fp32.

Megatron's `--exp-avg-dtype` / `--exp-avg-sq-dtype` (and, for the first moment only, MaxText's
`mu_dtype`) keep Adam's moments in a 2-byte dtype: 8 -> 4 bytes of moments per param (bf16
params, fp32 grads: Megatron's 18 -> 6 + 12/d bytes per param becomes 6 + 8/d). `store_state_in`
wraps any optax transformation: its state is kept in `dtype` between steps, upcast to fp32 for the
update (jzero's main params are fp32) and rounded back (round to nearest even) after it. Only the
floating leaves with at least one dim are stored low (moments, momentum, MultiSteps' accumulator);
scalars (step counts, injected hyperparameters) keep their dtype. The params the update reads and
the updates it returns stay fp32: only the moments carry bf16's 8-bit mantissa.

Limit: an exponential moving average `m = beta * m + (1 - beta) * x` stored by round-to-nearest
stops falling once `(1 - beta) * (m - x)` is below half of bf16's step at m (2**-9 to 2**-8 of m),
so it can sit up to 2**-8 / (1 - beta) above the fp32 value: within 8% at b2 = 0.95, 1.4x at 0.99,
32x at Adam's usual 0.999 (tests/zero/test_precision.py measures it). The CLI refuses b1 or b2 above
`config.BF16_MAX_DECAY` (0.96) with bf16 moments; a Python user wrapping their own chain must keep
its decays there too, or keep that moment in fp32.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from jzero.zero.common.groups import with_extra_args

PyTree = Any


def _stored(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating) and x.ndim > 0


def store_state_in(inner: optax.GradientTransformation, dtype) -> optax.GradientTransformationExtraArgs:
    """`inner` with its floating, non-scalar state leaves stored in `dtype` (module docstring).

    Element-wise if `inner` is (the flat path runs it); extra arguments (jzero's `param_groups`)
    reach `inner` unchanged.
    """
    dtype = jnp.dtype(dtype)
    inner = with_extra_args(inner)

    def init(params):
        return jax.tree.map(lambda x: x.astype(dtype) if _stored(x) else x, inner.init(params))

    def update(updates, state, params=None, **extra):
        full = jax.tree.map(lambda x: x.astype(jnp.float32) if _stored(x) else x, state)
        new_updates, new_state = inner.update(updates, full, params, **extra)
        return new_updates, jax.tree.map(lambda x: x.astype(dtype) if _stored(x) else x, new_state)

    return optax.GradientTransformationExtraArgs(init, update)
