"""A small pytree model for the tests of each jzero/zero module: a dict of four odd-shaped fp32 arrays
and a tiny loss, on a mesh of a few of the 8 simulated devices.

    w     [16, 6]    x @ w, column-parallel under tp: dim 0 divides every DP size, dim 1 only 2
    bias  [6]        1-D and named bias (no weight decay by Megatron's rule); divides 2, not 4
    v     [6, 12]    row-parallel under tp: dim 1 divides 2 and 4, not 8
    s     [3, 8, 5]  read through its mean: dim 1 (8) divides every DP size, dim 0 none

    loss(params, batch) = mean((tanh(x @ w + bias) @ v + mean(s) - y) ** 2),  batch {"x": [B, 16], "y": [B, 12]}
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from jzero.mesh import MeshConfig, make_mesh
from jzero.zero import build_zero
from jzero.zero.config import ZeroConfig

SHAPES = {"w": (16, 6), "bias": (6,), "v": (6, 12), "s": (3, 8, 5)}
TP_SPECS = {"w": P(None, "tp"), "bias": P("tp"), "v": P("tp", None), "s": P()}  # Megatron's column, then row
NO_TP = {k: P() for k in SHAPES}
BATCH = 16


def init_params(seed: int = 0, dtype=jnp.float32) -> dict:
    keys = jax.random.split(jax.random.key(seed), len(SHAPES))
    return {k: (0.3 * jax.random.normal(key, shape)).astype(dtype) for key, (k, shape) in zip(keys, SHAPES.items())}


def abstract(dtype=jnp.float32) -> dict:
    return jax.eval_shape(lambda: init_params(dtype=dtype))


def loss(params: dict, batch: dict, tp_axis: str | None = None) -> jax.Array:
    """The model's mean loss; on tp-local params (the flat path) the row-parallel output is summed over
    `tp_axis`, as Megatron's row-parallel layer does."""
    h = jnp.tanh(batch["x"] @ params["w"].astype(jnp.float32) + params["bias"].astype(jnp.float32))
    out = h @ params["v"].astype(jnp.float32)
    if tp_axis is not None:
        out = jax.lax.psum(out, tp_axis)
    return jnp.mean((out + jnp.mean(params["s"].astype(jnp.float32)) - batch["y"]) ** 2)


def batch(seed: int = 0, rows: int = BATCH) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "x": rng.standard_normal((rows, 16)).astype(np.float32),
        "y": rng.standard_normal((rows, 12)).astype(np.float32),
    }


def mesh(dp: int = 4, tp: int = 1, dp_outer: int = 1, ep: int = 1):
    """A (dp_outer, dp, ep, tp) mesh on the first dp_outer x dp x ep x tp devices."""
    return make_mesh(MeshConfig(dp=dp, ep=ep, tp=tp, dp_outer=dp_outer), jax.devices()[: dp_outer * dp * ep * tp])


def build(
    strategy: str = "optim_grads",
    path: str = "spec",
    *,
    dp: int = 4,
    tp: int = 1,
    inner: optax.GradientTransformation | None = None,
    dtype=jnp.float32,
    zero: dict | None = None,
    loss_fn=loss,
    **kwargs,
):
    """`build_zero` of this model (its `loss`, or `loss_fn`) with `inner` (default Adam, lr 1e-2) on a dp x tp mesh."""
    config = ZeroConfig(strategy=strategy, path=path, **(zero or {}))
    specs = TP_SPECS if tp > 1 else NO_TP
    inner = optax.adam(1e-2) if inner is None else inner
    return build_zero(loss_fn, inner, mesh(dp, tp), abstract(dtype), specs, config, **kwargs)


def optax_steps(inner: optax.GradientTransformation, params: dict, batches: list[dict]) -> dict:
    """Plain single-device optax from `params` over `batches` (no clipping): the params after them."""
    state = inner.init(params)
    for b in batches:
        grads = jax.grad(loss)(params, b)
        updates, state = inner.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return params
