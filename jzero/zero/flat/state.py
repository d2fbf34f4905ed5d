"""The flat path's train state: how its params and optimizer state are laid out, and the params in model space.

Optimizer state: the main params and every non-scalar state leaf one array per plan bucket,
[tp, S_b] dense or [ep * tp, S_b] expert ([L, ...] for a scanned stack's), split over the bucket's
`shard_axes` (`FlatPlan.bucket_specs()`); scalars (and the loss scaler's) replicated.

Model params: where they rest whole (DDP; ZeRO-1/2 without `overlap_param_gather`) the params
tree itself, tp-split and replicated over DP, as the spec path's. Where they rest sharded (ZeRO-3;
ZeRO-1/2 with `overlap_param_gather`, `Stage.params_rest_sharded`) one array per plan bucket in
the param dtype, shaped like the optimizer state's but split over the inner DP axes only
(`FlatBuffer.param_spec`): the step's forward gathers each unit's. `to_model_params` and
`from_model_params` convert them to and from the params tree (model space, `plan.param_shardings()`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jzero.errors import ConfigError
from jzero.zero.common import loss_scale as scaler
from jzero.zero.common import spike
from jzero.zero.common.state import ZeroState, keeps_main_params
from jzero.zero.config import DynamicLossScale, SpikeGuard
from jzero.zero.flat.convert import buckets_to_params, params_to_buckets
from jzero.zero.flat.plan import FlatPlan

PyTree = Any


def opt_state_shardings(
    inner: optax.GradientTransformation,
    fp: FlatPlan,
    loss_scale: DynamicLossScale | None = None,
    quantized: bool = False,
    spike_guard: SpikeGuard | None = None,
) -> ZeroState:
    """Main params and state leaves shaped like a bucket shard: bucket b's array in `fp.bucket_specs()[b]`;
    scalars (and the loss scaler's and spike guard's) replicated. Main params are kept as `state.keeps_main_params` says
    (a `quantized` gather keeps them for fp32 params too)."""
    mesh = fp.plan.mesh
    bucket_sh = [NamedSharding(mesh, spec) for spec in fp.bucket_specs()]
    shards = [jax.ShapeDtypeStruct(fp.shard_shape(b), jnp.float32) for b in range(fp.n_buckets)]

    def sharding(path, leaf):
        if not leaf.shape:
            return NamedSharding(mesh, P())
        b = getattr(path[-1], "idx", None) if path else None  # the state of bucket b sits at [..., b]
        if b is not None and b < fp.n_buckets and tuple(leaf.shape) == fp.shard_shape(b):
            return bucket_sh[b]
        raise ConfigError(
            f"zero.path=flat: optimizer state leaf {jax.tree_util.keystr(path)} of shape {leaf.shape} is neither a "
            "scalar nor shaped like a buffer shard; use zero.path=spec"
        )

    inner_sh = jax.tree_util.tree_map_with_path(sharding, jax.eval_shape(inner.init, shards))
    keep_main = keeps_main_params(jax.tree.leaves(fp.plan.tensors), quantized)
    return ZeroState(
        bucket_sh if keep_main else None, inner_sh, None if loss_scale is None else scaler.shardings(mesh),
        None if spike_guard is None else spike.shardings(mesh),
    )  # fmt: skip


def param_shardings(fp: FlatPlan) -> PyTree:
    """How the state holds the model params (module docstring): the params tree in the plan's tp
    shardings, or, where they rest sharded, one NamedSharding per plan bucket (`FlatBuffer.param_spec`)."""
    if fp.plan.stage.params_rest_sharded:
        return [NamedSharding(fp.plan.mesh, spec) for spec in fp.param_specs()]
    return fp.plan.param_shardings()


def to_model_params(fp: FlatPlan, params: PyTree) -> PyTree:
    """The state's params -> the params tree (global shapes, model dtypes); identity where they rest whole.
    Traceable: jit it with out_shardings `fp.plan.param_shardings()` and XLA moves only shards."""
    if not fp.plan.stage.params_rest_sharded:
        return params
    return jax.tree.unflatten(jax.tree.structure(fp.plan.tensors), buckets_to_params(fp, list(params)))


def from_model_params(fp: FlatPlan, params: PyTree) -> PyTree:
    """Inverse of `to_model_params`: the params tree -> what the state holds. Traceable."""
    if not fp.plan.stage.params_rest_sharded:
        return params
    return params_to_buckets(fp, jax.tree.leaves(params))
